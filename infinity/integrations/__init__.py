"""Ways into infinity from the tools people already train with.

- :mod:`infinity.integrations.transformers`: ``InfinityTrainerMixin`` and ``InfinityTrainer``
  (the Hugging Face ``Trainer`` driving an infinity engine);
- :mod:`infinity.integrations.trl`: ``InfinitySFTTrainer`` (TRL's ``SFTTrainer``).

Nothing else in infinity imports this package (it sits on top of the engine, the config,
``infinity.zero`` and the checkpoints).  See docs/trainers.md.
"""
