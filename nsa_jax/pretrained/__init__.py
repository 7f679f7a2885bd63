"""Pretrained dense checkpoints into the project's model (docs/PRETRAINED.md).

checkpoints.py reads a HF folder or a GGUF file one tensor at a time; families.py maps its
config onto a ModelConfig; weights.py lays its tensors out as the model's parameters (dense)
and starts NSA from them; tokenizer.py turns a GGUF vocabulary into a tokenizers JSON.
launch.convert is the command.
"""


class PretrainedError(ValueError):
    """A checkpoint that cannot be imported; the message is one line naming what and the fix."""
