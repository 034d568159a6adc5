"""A tiny random ``FluxPipeline`` built from configs and saved like a real one, so nothing is downloaded.

Flux because its transformer has a ``_cp_plan`` (diffusers' context parallelism can shard it,
which Z-Image and PixArt cannot) and because at these sizes (1 double + 1 single block, 2 heads of
16, a one-block VAE with 1 latent channel, CLIP and T5 encoders of 2 layers of width 32) it builds
and saves in 0.3 s, loads in 0.08 s and generates a 32x32 image in 3 steps in 0.07-1 s on a
2-core CPU (the spread is the shared machine's load). The tokenizers are built here too: CLIP's
over the 256 byte-level symbols (each also with ``</w>``) with no merges, T5's a Unigram over
lowercase letters and digits. Random weights: the images mean nothing, but they depend on the
seed and the prompt and are not flat (mean 111, std 46 at seed 0 for "a red fox"), so every image
metric has something to measure.
"""

from __future__ import annotations

import json
from pathlib import Path

# With diffusers' default init the attention hardly reaches the image (zeroing every attention output
# left it at 42 dB from the original): a planted attention fault would pass any threshold. Values and
# output projections 20x louder make the attention carry the image (see test_diffusers_pipeline.py).
LOUD_ATTENTION = ("attn.to_v.weight", "attn.add_v_proj.weight", "attn.to_out.0.weight", "attn.to_add_out.weight")
ATTENTION_GAIN = 20.0
# Image cases of the saved pipeline (the cases TOML a test writes next to it): 32x32, 3 steps, 1 and 2 ranks.
FLUX_CASES = """\
[defaults]
prompt = "a red fox"
height = 32
width = 32
num_inference_steps = 3
max_sequence_length = 16

[cases.flux_1rank]

[cases.flux_2ranks]
world_size = 2
"""


def _byte_symbols() -> list[str]:
    """GPT-2/CLIP's printable stand-ins for the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return [chr(b) for b in printable] + [chr(256 + i) for i, _ in enumerate(extra)]


def _clip_tokenizer(directory: Path):  # noqa: ANN202 - transformers' own type
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for piece in [*symbols, *(s + "</w>" for s in symbols)]:
        vocab.setdefault(piece, len(vocab))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=77)


def _t5_tokenizer():  # noqa: ANN202 - transformers' own type
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [
        ("<pad>", 0.0),
        ("</s>", 0.0),
        ("<unk>", 0.0),
        ("▁", -1.0),
        *((c, -2.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"),
    ]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=512,
    ), len(pieces)


def save_tiny_flux(directory: Path, seed: int = 0) -> Path:
    """Build the pipeline with weights from ``seed`` and ``save_pretrained`` it into ``directory/pipeline``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tokenizer = _clip_tokenizer(directory / "clip_vocab")
    t5_tokenizer, t5_vocab = _t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer),
                hidden_size=32,
                intermediate_size=37,
                num_attention_heads=4,
                num_hidden_layers=2,
                projection_dim=32,
                max_position_embeddings=77,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=t5_vocab,
                d_model=32,
                d_ff=37,
                d_kv=8,
                num_heads=4,
                num_layers=2,
                relative_attention_num_buckets=8,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        )
        with torch.no_grad():
            for name, param in transformer.named_parameters():
                if name.endswith(LOUD_ATTENTION):
                    param.mul_(ATTENTION_GAIN)
        vae = AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=1,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
        vae=vae,
    )
    pipe.save_pretrained(directory / "pipeline")
    return directory / "pipeline"


if __name__ == "__main__":  # python tests/targets/tiny_flux.py DIR: from any directory, e.g. a project of one's own
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tiny_flux.py DIR   (writes DIR/pipeline)")
    print(save_tiny_flux(Path(sys.argv[1])))
