"""Judging a policy: the greedy quick-eval per task during a run (`quick_eval`), the Pareto
front of evaluated steps (`pareto`), the Markdown report of a run (`report`) and answers to a
multiple-choice file as a submission CSV (`predict`)."""
