"""GPU checks of the vision path (run on a CUDA host from the repo root; set-up in
bench/README.md): (1) an image request through a separate vision actor handing
embeddings over CUDA IPC gives the same tokens as the engine running the tower itself;
(2) our video preprocessing against HF's video processor (torchvision exists there).
Prints a short table last."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np

PORT = 30001
TOPO = """
[model]
dtype = "float32"
[engine]
page_size = 16
[api]
mm_feature_transport = "cuda_ipc"
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "vision"
gpus = [0]
[[actors]]
kind = "engine"
gpus = [0]
[[actors]]
kind = "detokenizer"
"""


def post(route, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve(args, log):
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", *args, "--port", str(PORT)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            return proc
        except Exception:
            if proc.poll() is not None:
                raise SystemExit(open(log).read()[-3000:])
            time.sleep(1)
    raise SystemExit("not ready")


def image_tokens(args, log):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    proc = serve(args, log)
    try:
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}
        r = post("/v1/chat/completions", body)
        return r["choices"][0]["token_ids"], r["usage"]["prompt_tokens"]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, "-m", "cli.main", "make-checkpoint", "--preset", "tiny", "--out", "/tmp/tiny",
                    "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
    topo = "/tmp/vision_ipc.toml"
    open(topo, "w").write(TOPO)
    rows = []
    a = image_tokens(["--model", "/tmp/tiny", "--dtype", "float32", "--page-size", "16"], f"{out}/in_engine.log")
    b = image_tokens([topo, "--model", "/tmp/tiny"], f"{out}/vision_ipc.log")
    rows.append(("image: vision actor over cuda_ipc == tower in engine", a == b, f"{a} vs {b}"))
    try:
        from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

        from glmrt.vision import process_video
        clip = np.random.default_rng(3).integers(0, 256, (21, 48, 64, 3), dtype=np.uint8)
        hf = Glm5NextVideoProcessor()(videos=[clip], video_metadata=[{"total_num_frames": 21, "fps": 10.0,
                                                                       "duration": 2.1}],
                                      return_metadata=True, return_tensors="np")
        ours = process_video(list(clip), 10.0)
        grid_ok = ours.grid_thw == tuple(int(x) for x in hf["video_grid_thw"][0])
        idx_ok = ours.frame_indices == [int(i) for i in hf["video_metadata"][0].frames_indices]
        diff = float(np.abs(np.asarray(hf["pixel_values_videos"]) - ours.pixel_values).max())
        rows.append(("video: grid and sampled frames equal HF's", grid_ok and idx_ok, f"grid {ours.grid_thw}"))
        rows.append(("video: pixels within one uint8 level of HF's", diff < 1.1 / 255 / 0.26, f"max diff {diff:.4f}"))
    except Exception as e:  # noqa: BLE001
        rows.append(("video parity", False, f"could not run: {e}"))
    json.dump([list(r) for r in rows], open(f"{out}/vision_gpu_check.json", "w"), indent=1)
    print(f"{'check':<58} {'ok':<5} detail")
    for name, ok, detail in rows:
        print(f"{name:<58} {str(ok):<5} {detail}")


if __name__ == "__main__":
    main()
