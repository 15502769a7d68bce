"""`mogrpo plan CONFIG --gpu SIZE`: the plan, the verdict, the first fitting rung, exit status.

The run is test_memory.py's Llama-3-8B LoRA r 16 case (16 completions × 640 tokens, micro-batch
16): peak 58.48 GiB = always 16.43 (bf16 base 14.96, adapters 0.16, AdamW 0.31, 1 GiB fixed)
+ training 42.05 (activations 41.87 with 4 distinct prompts of 512 and 16 completions of 128,
the chunked head 0.19); test_memory.py pins those terms by hand."""

from __future__ import annotations

from pathlib import Path

from test_memory import write_run

from mogrpo.cli import main


def test_plan_that_fits_exits_0(tmp_path: Path, capsys):
    assert main(["plan", str(write_run(tmp_path)), "--gpu", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory estimate: llama, 8.03 B params")
    assert "peak                          58.48  = always 16.43 + training 42.05" in out
    assert out.endswith("\nfits: 58.5 of 80.0 GiB\n")


def test_plan_over_budget_names_the_first_rung_that_fits(tmp_path: Path, capsys):
    assert main(["plan", str(write_run(tmp_path)), "--gpu", "40GB"]) == 3
    out = capsys.readouterr().out
    # 40e9 bytes = 37.3 GiB; micro-batch 4 alone (one distinct prompt each) brings 58.5 to 27.2
    assert "does not fit: 58.5 GiB > 37.3 GiB (40GB = decimal units; write GiB for binary)" in out
    assert ("first fit: rung 1: micro-batch down, accumulation up: micro_batch_size 4, "
            "gradient_accumulation_steps 4 → 27.2 GiB") in out
    assert out.endswith("  --set train.micro_batch_size=4 "
                        "--set train.gradient_accumulation_steps=4\n")


def test_plan_gives_every_change_up_to_the_first_fit(tmp_path: Path, capsys):
    assert main(["plan", str(write_run(tmp_path)), "--gpu", "16GB"]) == 3
    out = capsys.readouterr().out
    # 14.9 GiB: the bf16 base alone is 14.96, so the 4-bit base (rung 3) is needed, after a
    # smaller micro-batch and checkpointing (which leaves room for micro-batch 8)
    assert "first fit: rung 3 after 2 cheaper changes: 4-bit NF4 base weights" in out
    assert out.endswith("  --set train.micro_batch_size=8 --set train.gradient_accumulation_steps=2"
                        " --set model.gradient_checkpointing=true --set model.load_in_4bit=true\n")


def test_plan_that_nothing_fits_and_bad_input(tmp_path: Path, capsys):
    path = str(write_run(tmp_path))
    assert main(["plan", path, "--gpu", "4GiB"]) == 3
    out = capsys.readouterr().out
    assert "does not fit: 58.5 GiB > 4.0 GiB\nno change on the ladder makes it fit" in out
    assert main(["plan", path, "--gpu", "lots"]) == 2
    assert "error: memory size 'lots' is not a size" in capsys.readouterr().err
    for zero in ("0", "0GB", "0.0 GiB"):  # a plan for no memory at all climbed the whole ladder
        assert main(["plan", path, "--gpu", zero]) == 2
        assert f"error: memory size '{zero}' is zero; write the GPU's memory" in \
            capsys.readouterr().err
    assert main(["plan", path]) == 2  # no GPU here, none given
    assert "error: no GPU visible here: pass --gpu 24GB" in capsys.readouterr().err
