"""Export the real-export zoo: torchvision and transformers architectures with random weights.

    pip install -e ".[zoo]"            # torch, torchvision, transformers, onnxscript (~5 GB; not for CI)
    python -m suites.zoo.export         # writes suites/zoo/*.onnx (weights stripped) and index.json
    python -m suites.zoo.export resnet18 bert_tiny   # only some

Each architecture is exported the way users do it: the TorchScript exporter (`dynamo=False`, opset 17)
and, where listed, the dynamo exporter (opset 18), whose graphs differ. Transformers come from small
configs (no hub is reachable, and small sizes keep CI fast) with the structure of the real thing:
BERT (post-LN, GELU, additive mask), GPT-2 (pre-LN, causal mask through Where, tanh GELU), and a
LLaMA-style decoder (RMSNorm, rotary embeddings, SiLU-gated MLP, grouped KV heads).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from fuseguard.suites.zoo import ZOO_DIR, strip_weights

SEQ = 64
VOCAB = 1000


@dataclass(frozen=True)
class Spec:
    name: str
    make: Callable[[], tuple[object, tuple, dict[str, tuple[tuple[int, ...], str]]]]
    source: str
    exporters: tuple[str, ...] = ("torchscript",)
    slow: bool = False
    tags: tuple[str, ...] = ()
    vocab: int = 0
    #: also export `<name>_dyn` with these dims symbolic ({input or output: {axis: name}}, torch's
    #: `dynamic_axes`): the form users ship for variable-length input (the dynamic-shape suite)
    dynamic_axes: dict | None = None


def _vision(name: str, size: int = 224, **kwargs):
    def make():
        import torch
        import torchvision

        torch.manual_seed(0)
        # nn.MultiheadAttention's eval fast path exports as aten::_native_multi_head_attention, which the
        # TorchScript exporter refuses; users switch it off to export ViTs.
        torch.backends.mha.set_fastpath_enabled(False)
        if name == "VisionTransformer":
            model = torchvision.models.VisionTransformer(image_size=size, **kwargs).eval()
        else:
            model = getattr(torchvision.models, name)(weights=None).eval()
        x = torch.randn(1, 3, size, size)
        return model, (x,), {"input": ((1, 3, size, size), "float32")}

    return make


def _first_output(base, call: Callable):  # noqa: ANN001, ANN202 - torch types, imported lazily
    """A Hugging Face model in eval mode with eager attention (the form users export: no SDPA kernel), wrapped
    to return its first output (the hidden states); ``call(base, *inputs)`` runs it."""
    import torch

    base.eval()
    try:
        base.config._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - older transformers have no switch
        pass

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base

        def forward(self, *inputs):
            return call(self.base, *inputs)[0]

    return Wrapped().eval()


def _hf(kind: str):
    def make():
        import torch
        import transformers as tf

        torch.manual_seed(0)
        if kind == "bert":
            config = tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=512, max_position_embeddings=128)
            base = tf.BertModel(config, add_pooling_layer=False)
        elif kind == "gpt2":
            config = tf.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=128,
                                   use_cache=False)
            base = tf.GPT2Model(config)
        elif kind == "roberta":     # position ids from a CumSum over the padding mask
            config = tf.RobertaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=512, max_position_embeddings=130)
            base = tf.RobertaModel(config, add_pooling_layer=False)
        elif kind == "llama":
            config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    use_cache=False)
            base = tf.LlamaModel(config)
        else:
            raise ValueError(kind)
        model = _first_output(base, lambda m, input_ids, attention_mask: m(input_ids=input_ids,
                                                                          attention_mask=attention_mask,
                                                                          use_cache=False))
        ids = torch.randint(0, VOCAB, (1, SEQ))
        mask = torch.ones(1, SEQ, dtype=torch.int64)
        return model, (ids, mask), {"input_ids": ((1, SEQ), "int64"),
                                               "attention_mask": ((1, SEQ), "int64")}

    return make


def _audio(kind: str):
    """Speech encoders: their front ends are conv1d stacks (Wav2Vec2: seven strided convs on the raw wave, a
    grouped positional conv; Whisper: two convs on the mel spectrogram)."""
    def make():
        import torch
        import transformers as tf

        torch.manual_seed(0)
        if kind == "wav2vec2":
            config = tf.Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=512, conv_dim=(128,) * 7, num_conv_pos_embeddings=32,
                                       num_conv_pos_embedding_groups=4)
            base, x, name = tf.Wav2Vec2Model(config), torch.randn(1, 16000), "input_values"
        elif kind == "whisper":
            config = tf.WhisperConfig(vocab_size=VOCAB, d_model=128, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=512,
                                      decoder_ffn_dim=512, num_mel_bins=80, max_source_positions=1500,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
            base, x, name = tf.WhisperModel(config).encoder, torch.randn(1, 80, 3000), "input_features"
        else:
            raise ValueError(kind)
        return _first_output(base, lambda m, features: m(features)), (x,), {name: (tuple(x.shape), "float32")}

    return make


#: batch and sequence symbolic, as Hugging Face's own ONNX exports name them
_TOKENS_DYNAMIC = {t: {0: "batch", 1: "seq"} for t in ("input_ids", "attention_mask", "output")}

SPECS: tuple[Spec, ...] = (
    Spec("resnet18", _vision("resnet18"), "torchvision.models.resnet18", ("torchscript", "dynamo")),
    Spec("mobilenet_v2", _vision("mobilenet_v2"), "torchvision.models.mobilenet_v2"),
    Spec("efficientnet_b0", _vision("efficientnet_b0"), "torchvision.models.efficientnet_b0", slow=True),
    Spec("shufflenet_v2_x1_0", _vision("shufflenet_v2_x1_0"), "torchvision.models.shufflenet_v2_x1_0"),
    Spec("vit_b_16", _vision("vit_b_16"), "torchvision.models.vit_b_16", slow=True, tags=("attention",)),
    Spec("vit_tiny", _vision("VisionTransformer", 64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=128,
                             mlp_dim=512),
         "torchvision.models.VisionTransformer (vit_b_16's code, 2 layers, hidden 128, 64x64)",
         ("torchscript", "dynamo"), tags=("attention",)),
    Spec("bert_tiny", _hf("bert"), "transformers.BertModel (2 layers, hidden 128)", ("torchscript", "dynamo"),
         tags=("attention",), vocab=VOCAB, dynamic_axes=_TOKENS_DYNAMIC),
    Spec("gpt2_tiny", _hf("gpt2"), "transformers.GPT2Model (2 layers, hidden 128)", tags=("attention",),
         vocab=VOCAB, dynamic_axes=_TOKENS_DYNAMIC),
    Spec("roberta_tiny", _hf("roberta"), "transformers.RobertaModel (2 layers, hidden 128)", tags=("attention",),
         vocab=VOCAB),
    Spec("wav2vec2_tiny", _audio("wav2vec2"), "transformers.Wav2Vec2Model (2 layers, hidden 128, 1 s of 16 kHz)",
         tags=("attention",)),
    Spec("whisper_tiny_enc", _audio("whisper"), "transformers.WhisperModel encoder (2 layers, d_model 128, 30 s)",
         tags=("attention",)),
    Spec("llama_tiny", _hf("llama"), "transformers.LlamaModel (2 layers, hidden 128, 4 heads / 2 KV)",
         tags=("attention",), vocab=VOCAB, dynamic_axes=_TOKENS_DYNAMIC),
)


def export_one(spec: Spec, exporter: str, dynamic: bool = False) -> onnx.ModelProto:
    import torch

    model, args, inputs = spec.make()
    names = list(inputs)
    with torch.no_grad():
        if exporter == "torchscript":
            buf = io.BytesIO()
            torch.onnx.export(model, args, buf, input_names=names, output_names=["output"], opset_version=17,
                              dynamo=False, do_constant_folding=True,
                              dynamic_axes=spec.dynamic_axes if dynamic else None)
            proto = onnx.load_from_string(buf.getvalue())
        else:
            program = torch.onnx.export(model, args, input_names=names, output_names=["output"], opset_version=18,
                                        dynamo=True)
            program.optimize()
            proto = program.model_proto
    return proto


def main(argv: list[str]) -> int:
    wanted = set(argv)
    index_path = ZOO_DIR / "index.json"
    index = {e["name"]: e for e in json.loads(index_path.read_text())} if index_path.is_file() else {}
    for spec in SPECS:
        if wanted and spec.name not in wanted:
            continue
        runs = [(e, False) for e in spec.exporters] + ([("torchscript", True)] if spec.dynamic_axes else [])
        for exporter, dynamic in runs:
            name = spec.name + ("_dyn" if dynamic else "" if exporter == "torchscript" else "_dynamo")
            try:
                proto = export_one(spec, exporter, dynamic)
            except Exception as err:  # noqa: BLE001 - one architecture failing to export must not stop the rest
                print(f"{name}: export failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                continue
            stripped = strip_weights(proto)
            path = ZOO_DIR / f"{name}.onnx"
            onnx.save(stripped, str(path))
            _, _, inputs = spec.make()
            index[name] = {"name": name, "file": path.name, "inputs": {k: [list(v[0]), v[1]] for k, v in inputs.items()},
                           "source": spec.source, "exporter": f"{exporter} opset {17 if exporter == 'torchscript' else 18}",
                           "slow": spec.slow, "tags": list(spec.tags), "vocab": spec.vocab}
            if dynamic:
                index[name]["dynamic"] = sorted({n for axes in spec.dynamic_axes.values() for n in axes.values()})
            print(f"{name}: {len(proto.graph.node)} nodes, {path.stat().st_size / 1024:.0f} KiB stripped")
    index_path.write_text(json.dumps([index[k] for k in sorted(index)], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
