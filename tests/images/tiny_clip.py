"""A tiny random CLIP saved like a real one (CLIPModel + CLIPImageProcessor), so nothing is downloaded.

Its similarities mean nothing about images; it exercises the path a real CLIP takes (local
directory → transformers → batched features → cosine) and gives the gate a clip figure.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_clip(directory: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = transformers.CLIPTextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.CLIPModel(config).save_pretrained(directory)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        directory
    )
    return directory
