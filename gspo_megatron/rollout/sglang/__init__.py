"""SGLang rollout servers: ``config`` (the config sections), ``protocol`` (pure request/response functions),
``http`` (standard-library client and retry), ``server`` (the server process), ``engine`` (the
``RolloutEngine`` over one or more servers), ``weight_sync`` (buckets, payloads, the trainer's NCCL group,
disk checkpoints) and ``cpu`` (real SGLang on CPU machines, for tests)."""
