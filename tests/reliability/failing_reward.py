"""A verifier that always raises: its failures must show in faults/reward_failures."""


def always_raises(sample, response):
    raise RuntimeError("verifier broken")


def huge(sample, response):
    """Finite, but beyond what float32 advantages can hold: 1e300 ** 2 overflows, the advantages would be NaN."""
    return 1e300


def parity(sample, response):
    """0 or 1 by the response's characters: a group of random responses gets both (non-zero variance)."""
    return float(sum(map(ord, response)) % 2)


def sleeps(sample, response):
    """Never returns in time (the demo's num_workers: 0 runs it in the trainer's own process); touches
    $GSPO_TEST_REWARD_STARTED first, so a test knows the rewards have begun."""
    import os
    import time

    open(os.environ["GSPO_TEST_REWARD_STARTED"], "w").close()
    time.sleep(3600)
    return 0.0


def loud(sample, response):
    """Prints 8 MB per response to stdout and stderr (a debug print left in a loop): the log must stay bounded."""
    import sys

    sys.stdout.write("o" * (4 << 20) + "\n")
    sys.stderr.write("e" * (4 << 20) + "\n")
    return 1.0


def returns_text(sample, response):
    """A reward that returns a string, not a number: every response fails the term."""
    return "1.0"


def constant(sample, response):
    """The same reward for every response: every group has zero variance, so dynamic sampling refills
    round after round."""
    return 1.0
