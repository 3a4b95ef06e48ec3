"""gspo-megatron: GSPO reinforcement learning for Mixture-of-Experts LLMs on Megatron-Core."""
__version__ = "0.1.0"
