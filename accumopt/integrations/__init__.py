"""Optional adapters (docs/frameworks/): ``lightning``, ``hf_trainer``,
``accelerate``; each imports its framework only when imported itself."""
