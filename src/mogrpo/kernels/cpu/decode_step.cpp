// The decoder layers of one native decode step on a CPU, in one call (see decode_step.py).
//
// A decode step of a small model is mostly the cost of launching its ~25 small operations a
// layer (norms, rotation, cache writes, attention, activation, residual sums), each a few
// microseconds of dispatch, allocation and iterator set-up around arithmetic that takes less.
// Here each layer is plain loops over buffers held for the whole decode, around the products
// the Python step runs (MKL's packed product, `cblas_sgemm_compute`, called at an address the
// Python side found; oneDNN's on its packed weights; ATen's linear on plain ones) and ATen's
// vectorised SiLU or tanh-approximated GELU.
//
// The arithmetic is the Python step's (`NativeDecoder._step_pairs`), in another summation order
// where it sums (norms, attention): results agree to float32 rounding, not to the bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

namespace {

// cblas_sgemm_compute(layout, transa, transb, m, n, k, a, lda, b, ldb, beta, c, ldc)
using Compute = void (*)(int, int, int, int, int, int, const float*, int, const void*, int,
                         float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kPacked = 151;
constexpr int kSiLU = 0, kGeluTanh = 1;  // a layer's activation (decode_step.ACTIVATIONS)


struct Product {
  const void* packed;  // MKL's packed weight [out, in], owned by the Python side; or null and
  at::Tensor weight;   // a weight [out, in]: oneDNN's packed layout, or a plain tensor
  int out, in;
  at::Tensor bias;  // [out], or undefined
};

// y = x w^T + b on oneDNN's packed weight w (mkldnn::_linear_pointwise, as the Python step)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct Layer {
  at::Tensor norm1, norm2;  // RMSNorm weights [hidden]
  float eps1, eps2;
  Product qkv, o, gate_up, down;
  int heads, kv_heads;
  float scaling;
  int activation;  // of the MLP's gate: kSiLU (Llama, Mistral, Qwen, Phi-3) or kGeluTanh (Gemma)
  // Qwen3's RMSNorms of each q head and each k head before the rotation (weights [D], in the
  // order of the pairs' rows), or undefined
  at::Tensor q_norm, k_norm;
  float q_eps, k_eps;
};

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// out = x / sqrt(mean(x^2) + eps) * weight, row by row ([rows, n])
void rms_norm(const float* x, const float* weight, float eps, int rows, int n, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * n;
    float* o = out + static_cast<int64_t>(r) * n;
    const float inverse = 1.f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) o[i] = xr[i] * inverse * weight[i];
  }
}

class Stack {
 public:
  // parallel_attention: the multiply-adds of a layer's attention (rows x heads x columns x
  // head dim) from which, on several threads, it runs as ATen's batched products (parallel)
  // rather than this file's single-threaded loops
  Stack(int64_t compute, int64_t max_rows, int64_t hidden, int64_t head_dim,
        int64_t parallel_attention)
      : compute_(reinterpret_cast<Compute>(compute)),  // 0: no MKL packed products
        parallel_attention_(parallel_attention),
        max_rows_(static_cast<int>(max_rows)),
        hidden_(static_cast<int>(hidden)),
        head_dim_(static_cast<int>(head_dim)),
        head_row_(static_cast<size_t>(head_dim)) {
    if (head_dim % 2) throw std::invalid_argument("the head dimension must be even");
  }

  // a product: `weight` is MKL's packed weight (its address, an int) or a tensor [out, in]
  Product product_of(const pybind11::object& weight, int64_t out, int64_t in,
                     const std::optional<at::Tensor>& bias) const {
    Product p{nullptr, at::Tensor(), static_cast<int>(out), static_cast<int>(in),
              bias_of(bias, out)};
    if (pybind11::isinstance<pybind11::int_>(weight)) {
      if (compute_ == nullptr) throw std::invalid_argument("no MKL compute function given");
      p.packed = reinterpret_cast<const void*>(weight.cast<int64_t>());
    } else {
      p.weight = weight.cast<at::Tensor>();
      if (p.weight.scalar_type() != at::kFloat || p.weight.dim() != 2 ||
          p.weight.size(0) != out || p.weight.size(1) != in)
        throw std::invalid_argument("a weight does not match its product");
    }
    return p;
  }

  void add_layer(at::Tensor norm1, double eps1, at::Tensor norm2, double eps2,
                 pybind11::object qkv, int64_t qkv_out, std::optional<at::Tensor> qkv_bias,
                 pybind11::object o, std::optional<at::Tensor> o_bias,
                 pybind11::object gate_up, int64_t gate_up_out,
                 std::optional<at::Tensor> gate_up_bias, pybind11::object down,
                 int64_t intermediate, std::optional<at::Tensor> down_bias, int64_t heads,
                 int64_t kv_heads, double scaling, int64_t activation,
                 std::optional<at::Tensor> q_norm, double q_eps, std::optional<at::Tensor> k_norm,
                 double k_eps) {
    const int64_t D = head_dim_, H = hidden_;
    if (heads % kv_heads || qkv_out != (heads + 2 * kv_heads) * D ||
        gate_up_out != 2 * intermediate)
      throw std::invalid_argument("inconsistent layer shapes");
    if (activation != kSiLU && activation != kGeluTanh)
      throw std::invalid_argument("unknown activation");
    Layer layer{norm1.contiguous(), norm2.contiguous(), static_cast<float>(eps1),
                static_cast<float>(eps2), product_of(qkv, qkv_out, H, qkv_bias),
                product_of(o, H, heads * D, o_bias),
                product_of(gate_up, gate_up_out, H, gate_up_bias),
                product_of(down, H, intermediate, down_bias), static_cast<int>(heads),
                static_cast<int>(kv_heads), static_cast<float>(scaling),
                static_cast<int>(activation), head_norm_of(q_norm),
                head_norm_of(k_norm), static_cast<float>(q_eps), static_cast<float>(k_eps)};
    layers_.push_back(std::move(layer));
    widest_ = std::max({widest_, static_cast<int>(qkv_out), static_cast<int>(gate_up_out),
                        static_cast<int>(heads * D), hidden_});
    q_width_ = std::max(q_width_, static_cast<int>(heads * D));
  }

  // The final norm and output head: `step` then returns the next-token logits [B, vocab].
  void set_head(at::Tensor norm, double eps, pybind11::object head, int64_t vocab,
                std::optional<at::Tensor> bias) {
    final_norm_ = norm.contiguous();
    final_eps_ = static_cast<float>(eps);
    head_ = product_of(head, vocab, hidden_, bias);
  }

  // x [B, hidden] (written in place) through every layer, at cache column `column`, then the
  // head where `set_head` gave one (logits returned; else x): turns [B, D/2, 2] (the new token's rotation, cos and sin per pair), bias
  // [B, H_kv, >= column + 1] (0 where a key may be attended, -inf elsewhere), keys and values
  // per layer [B, H_kv, T, D] with the head dimension contiguous.
  at::Tensor step(at::Tensor x, const at::Tensor& turns, const at::Tensor& bias,
                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                  int64_t column) {
    const int B = static_cast<int>(x.size(0)), H = hidden_, D = head_dim_;
    const int S = static_cast<int>(column) + 1;
    check(x, turns, bias, keys, values, B, S);
    allocate(B, S);
    float* xp = x.data_ptr<float>();
    float* h = norm_.data_ptr<float>();
    float* wide = wide_.data_ptr<float>();
    float* q = q_.data_ptr<float>();
    float* att = attended_.data_ptr<float>();
    float* scores = scores_.data_ptr<float>();
    const float* tp = turns.data_ptr<float>();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const int heads = L.heads, kv = L.kv_heads, turned = heads + kv;
      rms_norm(xp, L.norm1.data_ptr<float>(), L.eps1, B, H, h);
      product(L.qkv, h, H, B, wide);
      // q and k turned by the token's rotation (pairs side by side), k and v into the cache
      float* kp = keys[i].data_ptr<float>();
      float* vp = values[i].data_ptr<float>();
      const int64_t k0 = keys[i].stride(0), k1 = keys[i].stride(1), k2 = keys[i].stride(2);
      const int64_t v0 = values[i].stride(0), v1 = values[i].stride(1), v2 = values[i].stride(2);
      for (int b = 0; b < B; ++b) {
        const float* row = wide + static_cast<int64_t>(b) * L.qkv.out;
        const float* turn = tp + static_cast<int64_t>(b) * D;
        for (int hd = 0; hd < turned; ++hd) {
          const float* src = row + hd * D;
          const at::Tensor& head_norm = hd < heads ? L.q_norm : L.k_norm;
          if (head_norm.defined()) {  // Qwen3: the head normalised first, into a scratch row
            rms_norm(src, head_norm.data_ptr<float>(), hd < heads ? L.q_eps : L.k_eps, 1, D,
                     head_row_.data());
            src = head_row_.data();
          }
          float* dst = hd < heads ? q + (static_cast<int64_t>(b) * heads + hd) * D
                                  : kp + b * k0 + (hd - heads) * k1 + column * k2;
#pragma omp simd
          for (int p = 0; p < D / 2; ++p) {
            const float re = src[2 * p], im = src[2 * p + 1];
            const float c = turn[2 * p], s = turn[2 * p + 1];
            dst[2 * p] = re * c - im * s;
            dst[2 * p + 1] = re * s + im * c;
          }
        }
        for (int g = 0; g < kv; ++g)
          std::copy_n(row + (turned + g) * D, D, vp + b * v0 + g * v1 + column * v2);
      }
      // one query per head over the S columns of its key head: on several threads, a large
      // attention as ATen's batched products (parallel), else plain loops
      const int64_t work = static_cast<int64_t>(B) * heads * S * D;
      if (at::get_num_threads() > 1 && work >= parallel_attention_) {
        attend_parallel(L, keys[i], values[i], bias, B, S);
      } else {
        attend(L, q, keys[i], values[i], bias, att, scores, B, S);
      }
      add_product(L.o, att, heads * D, B, xp);
      rms_norm(xp, L.norm2.data_ptr<float>(), L.eps2, B, H, h);
      product(L.gate_up, h, H, B, wide);
      // act(gate) * up, written over the gate half (the down product reads it with stride)
      const int I = L.down.in;
      at::Tensor gate = wide_.view({-1})
                            .narrow(0, 0, static_cast<int64_t>(B) * L.gate_up.out)
                            .view({B, L.gate_up.out})
                            .narrow(1, 0, I);
      if (L.activation == kSiLU) {
        at::silu_(gate);
      } else {
        at::gelu_(gate, "tanh");
      }
      for (int b = 0; b < B; ++b) {
        float* gr = wide + static_cast<int64_t>(b) * L.gate_up.out;
        const float* up = gr + I;
#pragma omp simd
        for (int k = 0; k < I; ++k) gr[k] *= up[k];
      }
      add_product(L.down, wide, L.gate_up.out, B, xp);
    }
    if (!final_norm_.defined()) return x;
    rms_norm(xp, final_norm_.data_ptr<float>(), final_eps_, B, H, h);
    at::Tensor logits = at::empty({B, head_.out}, x.options());
    product(head_, h, H, B, logits.data_ptr<float>());
    return logits;
  }

 private:
  at::Tensor head_norm_of(const std::optional<at::Tensor>& weight) const {
    if (!weight.has_value()) return at::Tensor();
    at::Tensor w = weight->contiguous();
    if (w.numel() != head_dim_ || w.scalar_type() != at::kFloat)
      throw std::invalid_argument("a per-head norm's weight must be float32 [head dim]");
    return w;
  }

  static at::Tensor bias_of(const std::optional<at::Tensor>& bias, int64_t size) {
    if (!bias.has_value()) return at::Tensor();
    at::Tensor b = bias->contiguous();
    if (b.numel() != size || b.scalar_type() != at::kFloat)
      throw std::invalid_argument("a bias does not match its product");
    return b;
  }

  void check(const at::Tensor& x, const at::Tensor& turns, const at::Tensor& bias,
             const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, int B,
             int S) const {
    if (x.dim() != 2 || x.size(1) != hidden_ || !x.is_contiguous() ||
        x.scalar_type() != at::kFloat || B > max_rows_)
      throw std::invalid_argument("x must be contiguous float32 [rows <= max_rows, hidden]");
    if (turns.numel() != static_cast<int64_t>(B) * head_dim_ || !turns.is_contiguous() ||
        turns.scalar_type() != at::kFloat)
      throw std::invalid_argument("turns must be contiguous float32 [rows, D/2, 2]");
    if (bias.dim() != 3 || bias.size(0) != B || bias.size(2) < S ||
        bias.scalar_type() != at::kFloat)
      throw std::invalid_argument("bias must be float32 [rows, kv heads, >= column + 1]");
    if (keys.size() != layers_.size() || values.size() != layers_.size())
      throw std::invalid_argument("one key and one value cache per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      for (const at::Tensor* c : {&keys[i], &values[i]}) {
        if (c->dim() != 4 || c->size(0) != B || c->size(1) != layers_[i].kv_heads ||
            c->size(2) < S || c->size(3) != head_dim_ || c->stride(3) != 1 ||
            c->scalar_type() != at::kFloat)
          throw std::invalid_argument("caches must be float32 [rows, kv heads, >= column + 1, D]");
      }
      if (bias.size(1) != layers_[i].kv_heads)
        throw std::invalid_argument("bias must be float32 [rows, kv heads, >= column + 1]");
    }
  }

  // attention of the B rows' queries (q_) into attended_, as plain loops
  void attend(const Layer& L, const float* q, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& bias, float* att, float* scores, int B, int S) const {
    const int D = head_dim_, heads = L.heads, kv = L.kv_heads, G = heads / kv;
    const float* kp = keys.data_ptr<float>();
    const float* vp = values.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    const int64_t k0 = keys.stride(0), k1 = keys.stride(1), k2 = keys.stride(2);
    const int64_t v0 = values.stride(0), v1 = values.stride(1), v2 = values.stride(2);
    const int64_t b0 = bias.stride(0), b1 = bias.stride(1), b2 = bias.stride(2);
    for (int b = 0; b < B; ++b) {
      for (int g = 0; g < kv; ++g) {
        const float* K = kp + b * k0 + g * k1;
        const float* V = vp + b * v0 + g * v1;
        const float* add = bp + b * b0 + g * b1;
        for (int j = 0; j < G; ++j) {
          const int head = g * G + j;
          const float* qh = q + (static_cast<int64_t>(b) * heads + head) * D;
          float top = -INFINITY;
          for (int s = 0; s < S; ++s) {
            scores[s] = dot(qh, K + s * k2, D) * L.scaling + add[s * b2];
            top = std::max(top, scores[s]);
          }
          float total = 0.f;
          for (int s = 0; s < S; ++s) {
            scores[s] = std::exp(scores[s] - top);
            total += scores[s];
          }
          float* out = att + (static_cast<int64_t>(b) * heads + head) * D;
          std::fill_n(out, D, 0.f);
          for (int s = 0; s < S; ++s) {
            const float p = scores[s] / total;
            const float* vs = V + s * v2;
#pragma omp simd
            for (int d = 0; d < D; ++d) out[d] += p * vs[d];
          }
        }
      }
    }
  }

  // the same attention as ATen's batched products, which run on every thread torch has
  void attend_parallel(const Layer& L, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& bias, int B, int S) {
    const int64_t D = head_dim_, kv = L.kv_heads, G = L.heads / L.kv_heads;
    // q_ and attended_ hold [B, heads * D] packed from their start, as the loops use them
    const auto rows = [&](const at::Tensor& buffer) {
      return buffer.view({-1}).narrow(0, 0, B * L.heads * D).view({B * kv, G, D});
    };
    at::Tensor q = rows(q_);
    at::Tensor k = keys.narrow(2, 0, S).reshape({B * kv, S, D});
    at::Tensor v = values.narrow(2, 0, S).reshape({B * kv, S, D});
    at::Tensor add = bias.narrow(2, 0, S).reshape({B * kv, 1, S});
    at::Tensor scores = at::baddbmm(add, q, k.transpose(1, 2), 1.0, L.scaling);
    at::Tensor out = rows(attended_);
    at::bmm_out(out, at::softmax(scores, -1), v);
  }

  void allocate(int B, int S) {
    if (!norm_.defined()) {
      const auto f = at::TensorOptions().dtype(at::kFloat);
      norm_ = at::empty({max_rows_, hidden_}, f);
      wide_ = at::empty({max_rows_, widest_}, f);
      q_ = at::empty({max_rows_, q_width_}, f);
      attended_ = at::empty({max_rows_, q_width_}, f);
    }
    if (!scores_.defined() || scores_.numel() < S)
      scores_ = at::empty({std::max<int64_t>(S, 64) * 2}, at::TensorOptions().dtype(at::kFloat));
  }

  // out [B, p.out] = x [B, p.in] (rows `lda` apart) w^T + bias
  void product(const Product& p, const float* x, int lda, int B, float* out) const {
    if (p.packed == nullptr) {  // oneDNN or ATen, into a tensor of their own, copied here
      at::Tensor input = at::from_blob(const_cast<float*>(x), {B, p.in}, {lda, 1},
                                       at::TensorOptions().dtype(at::kFloat));
      at::Tensor y = p.weight.is_mkldnn()
                         ? onednn_linear(input.contiguous(), p.weight, p.bias)
                         : at::linear(input, p.weight,
                                      p.bias.defined() ? std::optional<at::Tensor>(p.bias)
                                                       : std::nullopt);
      std::copy_n(y.contiguous().data_ptr<float>(), static_cast<int64_t>(B) * p.out, out);
      return;
    }
    float beta = 0.f;
    if (p.bias.defined()) {
      const float* bias = p.bias.data_ptr<float>();
      for (int b = 0; b < B; ++b) std::copy_n(bias, p.out, out + static_cast<int64_t>(b) * p.out);
      beta = 1.f;
    }
    compute_(kRowMajor, kNoTrans, kPacked, B, p.out, p.in, x, lda, p.packed, 0, beta, out, p.out);
  }

  // acc [B, p.out] += x w^T + bias
  void add_product(const Product& p, const float* x, int lda, int B, float* acc) {
    if (!p.bias.defined() && p.packed != nullptr) {
      compute_(kRowMajor, kNoTrans, kPacked, B, p.out, p.in, x, lda, p.packed, 0, 1.f, acc,
               p.out);
      return;
    }
    if (!extra_.defined() || extra_.numel() < static_cast<int64_t>(B) * p.out)
      extra_ = at::empty({static_cast<int64_t>(max_rows_) * p.out},
                         at::TensorOptions().dtype(at::kFloat));
    float* tmp = extra_.data_ptr<float>();
    product(p, x, lda, B, tmp);
    const int64_t n = static_cast<int64_t>(B) * p.out;
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) acc[k] += tmp[k];
  }

  at::Tensor final_norm_;
  float final_eps_ = 0.f;
  Product head_{};
  Compute compute_;
  int64_t parallel_attention_;
  int max_rows_, hidden_, head_dim_;
  int widest_ = 0, q_width_ = 0;
  std::vector<Layer> layers_;
  std::vector<float> head_row_;  // one head normalised by a per-head norm
  at::Tensor norm_, wide_, q_, attended_, scores_, extra_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Stack>(m, "Stack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &Stack::add_layer)
      .def("set_head", &Stack::set_head)
      // the GIL is let go while a step runs (its arguments are converted before): other
      // Python threads — a server's other requests — go on meanwhile
      .def("step", &Stack::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
