"""accumopt inside the frameworks people train with: thin, optional adapters.

Each submodule imports its framework only when it is imported itself, and no framework is a
dependency of accumopt's core; ``pip install "accumopt[lightning]"`` (``[transformers]``,
``[accelerate]``) installs one.

- :mod:`accumopt.integrations.lightning`: Lightning's automatic and manual optimization.
- :mod:`accumopt.integrations.hf_trainer`: the Hugging Face ``transformers.Trainer``.
- :mod:`accumopt.integrations.accelerate`: Hugging Face Accelerate's ``prepare``.
- :mod:`accumopt.integrations.dcp`: ``torch.distributed.checkpoint`` (package-internal: DCP
  takes the plain wrapper, nothing to call).
"""
