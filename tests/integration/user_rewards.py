"""A user's own reward module, loaded by import path in the integration tests."""


def distinct_chars(prompts, completions, **columns):
    """Varies between any two different completions, so every group carries a signal."""
    return [len(set(c)) / 10 for c in completions]


def unscorable_when_long(prompts, completions, completion_lengths, **columns):
    """None (could not score) for long completions, as a judge that timed out would."""
    return [None if n > 6 else 1.0 for n in completion_lengths]


def constant(prompts, completions, **columns):
    """The same score for every completion: a group scored by it carries no signal."""
    return [0.5] * len(completions)


_calls = 0


def kill_on_call(prompts, completions, **columns):
    """Scores 0; on the call numbered by $KILL_ON_REWARD_CALL the process SIGKILLs itself —
    a crash in the middle of a step, after its rollout was generated. With $KILL_RANK set,
    only that process of a torchrun launch kills itself."""
    import os
    import signal

    global _calls
    _calls += 1
    rank = os.environ.get("KILL_RANK")
    if os.environ.get("KILL_ON_REWARD_CALL") == str(_calls) \
            and (rank is None or rank == os.environ.get("RANK")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)


def kill_in_update(prompts, completions, **columns):
    """Scores 0; on the call numbered by $KILL_IN_UPDATE_CALL (in the process of rank
    $KILL_RANK, if set) it arms a hook that SIGKILLs the process at the next forward of any
    module — the update's first forward after this step's rewards: a crash mid-update."""
    import os
    import signal

    import torch

    global _calls
    _calls += 1
    rank = os.environ.get("KILL_RANK")
    if os.environ.get("KILL_IN_UPDATE_CALL") == str(_calls) \
            and (rank is None or rank == os.environ.get("RANK")):
        def kill(module, args, output):
            os.kill(os.getpid(), signal.SIGKILL)

        torch.nn.modules.module.register_module_forward_hook(kill)
    return [0.0] * len(completions)
