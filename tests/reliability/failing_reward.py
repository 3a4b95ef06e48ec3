"""A verifier that always raises: its failures must show in faults/reward_failures."""


def always_raises(sample, response):
    raise RuntimeError("verifier broken")
