"""The NSA attention layer (layer.py) and its branch modules: compression (phi) and the block-scorer distillation."""
