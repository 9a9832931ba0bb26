"""Optional adapters (README "Using accumopt with your framework"): ``lightning``, ``hf_trainer``,
``accelerate``; each imports its framework only when imported itself."""
