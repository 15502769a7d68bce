"""The GRPO math as pure functions on tensors: log-probs (`logprobs`), advantages
(`advantages`), KL estimators (`kl`) and controllers (`kl_control`), the loss (`loss`) and its policy terms (`surrogates`),
importance weights for another sampler (`importance`), dynamic sampling (`dynamic_sampling`), reward-weight schedules (`schedules`), and the names
of every option (`choices`).

Nothing is imported here, so the config can read `choices` without importing torch."""
