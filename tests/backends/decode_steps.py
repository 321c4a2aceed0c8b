"""The tiny model's logits through a prefill, an eager decode step and three decode CUDA graph
replays on the GPU (cuda-h200): launch-mode switches (PDL, side streams) must leave them bit for
bit alike."""

from __future__ import annotations

import torch


def decode_logits(rows: int = 3) -> torch.Tensor:
    from backends.cuda_h200 import CudaH200Ops
    from glmrt.checkpoint.presets import preset_config
    from glmrt.engine.cuda_graphs import DecodeGraphs
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    g = torch.Generator().manual_seed(7)
    model = load_dummy(preset_config("tiny"), CudaH200Ops(), dtype=torch.bfloat16, device="cuda", seed=1,
                       with_vision=False, with_mtp=False)
    prompts = [torch.randint(1, 900, (n,), generator=g) for n in (37, 50, 9, 21)[:rows]]
    sess = DirectSession(model, max_requests=len(prompts) + 1, max_tokens=128, shuffle_pages=False)
    rids = [sess.new_request() for _ in prompts]
    first = sess.step({r: p for r, p in zip(rids, prompts)}, all_logits=False)
    eager = sess.step({r: torch.randint(1, 900, (1,), generator=g) for r in rids}, all_logits=False)
    out = [torch.cat([first[r] for r in rids]).float(), torch.cat([eager[r] for r in rids]).float()]
    graphs = DecodeGraphs(model, sess.cache, max_bs=len(rids), max_pages=sess.pages_per_req,
                          pad_slot=len(rids), pad_page=sess._free_pages[0])
    for _ in range(3):
        ids = torch.randint(1, 900, (len(rids),), generator=g).tolist()
        lens = [sess.lens[r] for r in rids]
        key = graphs.key(len(rids), max(n // sess.page_size + 1 for n in lens))
        out.append(graphs.run(key, ids, lens, [sess.slots[r] for r in rids],
                              [sess.pages[r] for r in rids]).float().clone())
        for r in rids:
            sess.lens[r] += 1
    torch.cuda.synchronize()
    return torch.stack(out)
