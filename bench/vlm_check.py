"""Qwen2.5-VL on a device against transformers on the same weights, before any timing:
the tiny random checkpoint of the tests (``tests/hf_models.write_tiny_vlm``), float32,
TF32 off. Checks: the vision tower's output for one and for two images (relative error
= max |ours - theirs| / max |theirs|, bound 1e-4), and greedy generation with one image
and with two (token-identical to transformers' ``generate``). Each check reports on its
own; the JSON holds every figure and error.

    python bench/vlm_check.py --device cuda --out $OUT/vlm_check.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hf_models import VL_IMAGE_TOKEN, VL_PROCESSOR, random_image, vl_reference, write_tiny_vlm  # noqa: E402

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loader import load_image_processor, load_vision_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.vision import place_images, prepare_image  # noqa: E402

TOLERANCE = 1e-4
NEW_TOKENS = 16
SIZES = [(130, 100), (90, 150), (200, 120)]


def _pixels(images: list[bytes], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Qwen2VLImageProcessorPil(**VL_PROCESSOR)(
        images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt"
    )
    return out["pixel_values"].to(device), out["image_grid_thw"].to(device)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def check_tower(folder: Path, ref, images: list[bytes], device: str) -> dict:
    tower = load_vision_model(str(folder), device, torch.float32, progress=False).tower
    errors = []
    for batch in (images[:1], images[1:3]):
        pixels, grid = _pixels(batch, device)
        with torch.no_grad():
            theirs = ref.model.visual(pixels, grid_thw=grid).pooler_output
            mine = tower(pixels, [tuple(g) for g in grid.tolist()])
        errors.append(_relative_error(mine, theirs))
    return {"relative_errors": errors, "ok": max(errors) <= TOLERANCE}


def _prompt(folder: Path, images: list[bytes], text: str) -> tuple[list[int], list]:
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": parts}]))
    processor = load_image_processor(str(folder))
    return place_images(ids, VL_IMAGE_TOKEN, [prepare_image(processor, d, 1 << 24) for d in images])


def check_generation(folder: Path, ref, images: list[bytes], device: str) -> dict:
    llm = LLM(EngineConfig(
        model=str(folder), device=device, dtype="float32", num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    ))  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    cases = [(images[:1], "Describe it."), (images[1:3], "Compare them.")]
    result = {"cases": []}
    for imgs, text in cases:
        ids, media = _prompt(folder, imgs, text)
        pixels, grid = _pixels(imgs, device)
        input_ids = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = ref.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               pixel_values=pixels, image_grid_thw=grid,
                               mm_token_type_ids=(input_ids == VL_IMAGE_TOKEN).int(),
                               max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
        theirs = out[0, len(ids) :].tolist()
        ours = llm.generate([ids], greedy, [media])[0].token_ids
        result["cases"].append({"images": len(imgs), "prompt_tokens": len(ids),
                                "identical": ours == theirs, "ours": ours,
                                "theirs": theirs})  # fmt: skip
    result["ok"] = all(c["identical"] for c in result["cases"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="vlm_check.json")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = write_tiny_vlm(Path(tempfile.mkdtemp(prefix="ferry-vlm-check-")))
    ref = vl_reference().to(args.device)
    images = [random_image(i, w, h) for i, (w, h) in enumerate(SIZES)]
    report: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    for name, check in (("tower", check_tower), ("generation", check_generation)):
        try:
            report[name] = check(folder, ref, images, args.device)
        except Exception as exc:  # each check reports on its own
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "traceback"}),
              flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(report[n]["ok"] for n in ("tower", "generation")) else 1


if __name__ == "__main__":
    sys.exit(main())
