"""Export a survey of real architectures beyond the zoo (torchvision and transformers, their own random init,
weights kept) to check fuseguard on models the repo does not carry.

    pip install -e ".[zoo]"
    python benchmarks/export_survey.py [--dynamo | --dynamic] [NAME...]   # writes $FUSEGUARD_SURVEY_DIR (default /tmp/extra)
    fuseguard verify /tmp/extra/*.onnx && fuseguard bench /tmp/extra/*.onnx --processes 2 --repeats 8

Not part of any test: the models are large and need torch (~5 GB).
"""
import io
import os
import sys

import onnx
import torch
import torchvision
import transformers as tf

torch.manual_seed(0)
torch.backends.mha.set_fastpath_enabled(False)
out = os.environ.get("FUSEGUARD_SURVEY_DIR", "/tmp/extra")
os.makedirs(out, exist_ok=True)

DYNAMO = "--dynamo" in sys.argv    # the exporter torch >= 2.9 uses by default, at its default opset: NAME_dynamo.onnx
DYNAMIC = "--dynamic" in sys.argv  # TorchScript with dynamic_axes, as served models are: batch (and seq for tokens): NAME_dyn.onnx
AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}

def export(name, model, args, names, dynamo=DYNAMO):
    model.eval()
    with torch.no_grad():   # a zero-initialised weight (torchvision ViT's head) makes an output constant: vacuous checks
        for pname, prm in model.named_parameters():
            if not pname.endswith("bias") and prm.numel() > 1 and prm.abs().max() == 0:
                torch.nn.init.normal_(prm, std=0.02) if prm.dim() > 1 else torch.nn.init.ones_(prm)
    try:
        with torch.no_grad():
            if dynamo:
                prog = torch.onnx.export(model, args, input_names=names, output_names=["output"], dynamo=True)
                prog.optimize(); proto = prog.model_proto; name += "_dynamo"
            else:
                buf = io.BytesIO()
                axes = {n: AXES.get(n, {0: "batch"}) for n in names} if DYNAMIC else None
                torch.onnx.export(model, args, buf, input_names=names, output_names=["output"], opset_version=17, dynamo=False, do_constant_folding=True, dynamic_axes=axes)
                proto = onnx.load_from_string(buf.getvalue()); name += "_dyn" if DYNAMIC else ""
        onnx.save(proto, f"{out}/{name}.onnx")
        print(name, len(proto.graph.node), "nodes", flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e).splitlines()[0][:200], flush=True)

want = set(sys.argv[1:]) - {"--dynamo", "--dynamic"}
vis = ["resnext50_32x4d", "convnext_tiny", "regnet_y_400mf", "mnasnet1_0", "mobilenet_v3_large", "googlenet",
       "squeezenet1_1", "swin_t", "efficientnet_b1", "regnet_x_800mf", "shufflenet_v2_x0_5", "mobilenet_v3_small", "densenet121"]
for v in vis:
    if want and v not in want: continue
    kw = {"aux_logits": False, "init_weights": True} if v == "googlenet" else {}
    m = getattr(torchvision.models, v)(weights=None, **kw)
    export(v, m, (torch.randn(1, 3, 224, 224),), ["input"])

class Out(torch.nn.Module):
    """Segmentation models return a dict: export its "out"."""
    def __init__(self, base): super().__init__(); self.base = base
    def forward(self, x): return self.base(x)["out"]

# Second survey (2026-12-05): segmentation, video, bigger ViTs
seg, img = torchvision.models.segmentation, (torch.randn(1, 3, 224, 224),)
for name, build, args in [
        ("lraspp_mobilenet_v3", lambda: Out(seg.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None)), img),
        ("deeplabv3_mobilenet_v3", lambda: Out(seg.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                                aux_loss=False)), img),
        ("fcn_resnet50", lambda: Out(seg.fcn_resnet50(weights=None, weights_backbone=None, aux_loss=False)), img),
        ("r3d_18", lambda: torchvision.models.video.r3d_18(weights=None), (torch.randn(1, 3, 8, 112, 112),)),
        ("efficientnet_v2_s", lambda: torchvision.models.efficientnet_v2_s(weights=None), img),
        ("swin_v2_t", lambda: torchvision.models.swin_v2_t(weights=None), img),
        ("maxvit_t", lambda: torchvision.models.maxvit_t(weights=None), img),
        ("vit_b_32", lambda: torchvision.models.vit_b_32(weights=None), img)]:
    if not want or name in want:
        export(name, build(), args, ["input"])

class Wrap(torch.nn.Module):
    def __init__(self, base, kw): super().__init__(); self.base = base; self.kw = kw
    def forward(self, *a):
        if len(a) == 2 and self.kw.get("use_cache") is False:   # decoder models: the mask by name, not as the cache
            return self.base(a[0], attention_mask=a[1], **self.kw)[0]
        return self.base(*a, **self.kw)[0]

def hf(name, base, args, names, **kw):
    if want and name not in want: return
    base.eval()
    try: base.config._attn_implementation = "eager"
    except Exception: pass
    export(name, Wrap(base, kw), args, names)

ids = torch.randint(0, 1000, (1, 64)); mask = torch.ones(1, 64, dtype=torch.int64)
hf("distilbert", tf.DistilBertModel(tf.DistilBertConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=2, hidden_dim=512, max_position_embeddings=128)), (ids, mask), ["input_ids", "attention_mask"])
hf("roberta", tf.RobertaModel(tf.RobertaConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, max_position_embeddings=130), add_pooling_layer=False), (ids, mask), ["input_ids", "attention_mask"])
hf("t5_enc", tf.T5EncoderModel(tf.T5Config(vocab_size=1000, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4)), (ids, mask), ["input_ids", "attention_mask"])
hf("qwen2", tf.Qwen2Model(tf.Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("albert", tf.AlbertModel(tf.AlbertConfig(vocab_size=1000, embedding_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, max_position_embeddings=128), add_pooling_layer=False), (ids, mask), ["input_ids", "attention_mask"])
wcfg = tf.WhisperConfig(vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=512, decoder_ffn_dim=512, num_mel_bins=80, max_source_positions=1500, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
hf("whisper_enc", tf.WhisperModel(wcfg).encoder, (torch.randn(1, 80, 3000),), ["input_features"])
w2 = tf.Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, conv_dim=(128,)*7, num_conv_pos_embeddings=32, num_conv_pos_embedding_groups=4)
hf("wav2vec2", tf.Wav2Vec2Model(w2), (torch.randn(1, 16000),), ["input_values"])
hf("vit_hf", tf.ViTModel(tf.ViTConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, image_size=224, patch_size=16), add_pooling_layer=False), (torch.randn(1, 3, 224, 224),), ["pixel_values"])

# Second survey (2026-12-05): more encoders, decoders, vision and speech models
small = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
             max_position_embeddings=128)
hf("mobilebert", tf.MobileBertModel(tf.MobileBertConfig(**small, embedding_size=64, intra_bottleneck_size=64, true_hidden_size=64), add_pooling_layer=False), (ids, mask), ["input_ids", "attention_mask"])
hf("electra", tf.ElectraModel(tf.ElectraConfig(**small, embedding_size=64)), (ids, mask), ["input_ids", "attention_mask"])
hf("deberta_v2", tf.DebertaV2Model(tf.DebertaV2Config(**small, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=32)), (ids, mask), ["input_ids", "attention_mask"])
hf("bart", tf.BartModel(tf.BartConfig(vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=128)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("gpt_neo", tf.GPTNeoModel(tf.GPTNeoConfig(vocab_size=1000, hidden_size=128, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]], window_size=16, max_position_embeddings=128)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("bloom", tf.BloomModel(tf.BloomConfig(vocab_size=1000, hidden_size=128, n_layer=2, n_head=2)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("phi", tf.PhiModel(tf.PhiConfig(**small, partial_rotary_factor=0.5)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("mistral", tf.MistralModel(tf.MistralConfig(**small, num_key_value_heads=1, sliding_window=16)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("gemma", tf.GemmaModel(tf.GemmaConfig(**small, num_key_value_heads=1, head_dim=64)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
hf("falcon", tf.FalconModel(tf.FalconConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False)), (ids, mask), ["input_ids", "attention_mask"], use_cache=False)
px, wav = torch.randn(1, 3, 224, 224), torch.randn(1, 16000)
hf("mobilevit", tf.MobileViTModel(tf.MobileViTConfig(image_size=224, hidden_sizes=[64, 80, 96], neck_hidden_sizes=[16, 32, 48, 64, 80, 96, 384])), (px,), ["pixel_values"])
hf("segformer", tf.SegformerModel(tf.SegformerConfig(hidden_sizes=[32, 64, 160, 256], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 5, 8], decoder_hidden_size=128)), (px,), ["pixel_values"])
hf("convnextv2", tf.ConvNextV2Model(tf.ConvNextV2Config(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1])), (px,), ["pixel_values"])
hf("levit", tf.LevitModel(tf.LevitConfig(image_size=224)), (px,), ["pixel_values"])
hf("beit", tf.BeitModel(tf.BeitConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, use_relative_position_bias=True), add_pooling_layer=False), (px,), ["pixel_values"])
hf("dinov2", tf.Dinov2Model(tf.Dinov2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=4, image_size=224, patch_size=14)), (px,), ["pixel_values"])
hf("clip_vision", tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, image_size=224, patch_size=32)), (px,), ["pixel_values"])
hf("hubert", tf.HubertModel(tf.HubertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, conv_dim=(128,)*7, num_conv_pos_embeddings=32, num_conv_pos_embedding_groups=4)), (wav,), ["input_values"])
hf("wavlm", tf.WavLMModel(tf.WavLMConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, conv_dim=(128,)*7, num_conv_pos_embeddings=32, num_conv_pos_embedding_groups=4)), (wav,), ["input_values"])
