"""Hugging Face integration (the ``zeropp[hf]`` extra): train a ``transformers`` model with
``transformers.Trainer`` through zeropp, and resolve Hugging Face's ``"auto"`` config values.

    from zeropp.hf import ZeroppTrainer
    trainer = ZeroppTrainer(model=model, args=training_args, train_dataset=data, zeropp_config="ds_config.json")
    trainer.train()
    trainer.save_model("out")          # every rank; rank 0 writes config.json + model.safetensors

``from_pretrained(path)`` builds a model from its safetensors checkpoint with each rank reading only its own
chunks, for models larger than one rank's memory.

See docs/hf.md for what is supported.
"""
try:
    import accelerate  # noqa: F401 - the Trainer's dependency, imported here so a missing one fails early
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by tests/unit/test_hf_auto.py in a subprocess
    raise ImportError(f"zeropp.hf needs Hugging Face transformers and accelerate ({err}): "
                      "pip install 'zeropp[hf]'") from err

from zeropp.hf.pretrained import from_pretrained
from zeropp.hf.trainer import ZeroppTrainer, ZeroppTrainerError, unsupported_arguments
from zeropp.hf.values import TrainerConfigMismatch, auto_values, hidden_size_of, trainer_config

__all__ = ["ZeroppTrainer", "from_pretrained", "ZeroppTrainerError", "TrainerConfigMismatch", "auto_values", "hidden_size_of",
           "trainer_config", "unsupported_arguments"]
