"""One module per model family, behind one registry (``registry.py``).

A family module holds everything the project knows about one Hugging Face ``model_type``: how its
``config.json`` maps to and from the typed ``ModelConfig`` (``megatron/model_config.py``), its weight table
(HF tensor names <-> canonical Megatron names, expanded by ``conversion/tables.py``) and what the
transformers rollout engine needs (``rollout/hf_engine.py``). Adding a family means adding one module and
one line in ``registry.py``.

Layering: this package imports only ``typed_config`` and itself; ``megatron/``, ``conversion/`` and
``rollout/`` import it, never the other way round.
"""
