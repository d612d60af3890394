"""Batch-1 and batch-8 greedy decoding of the 88m default with Inductor's PDL (programmatic dependent
launch) off or on: python scratch/pdl_probe.py TAG (TORCHINDUCTOR_ENABLE_PDL=1 for on). Writes TAG.json."""
import json, os, sys
import torch
import config as C, generate as G, measure as ME, model as M

tag = sys.argv[1]
dev = torch.device("cuda")
cfg = ME.decode_variant(C.preset("88m").model, ("fused_decode", "split_decode", "decode_mlp"))
torch.manual_seed(0)
net = M.Llama(cfg).to(dev, torch.bfloat16).eval()
prompt = torch.randint(1, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
out = {"pdl": torch._inductor.config.triton.enable_pdl}
for mode, batches in (("max-autotune-no-cudagraphs", (1,)), ("default", (1, 8))):
    for b in batches:
        row, tokens = ME.decode_speed(net, prompt, b, 500, G.decoder(net, dev, True, mode))
        out[f"{mode} b{b}"] = {"tok_s": row["decode_tok_s"], "replay_us": row.get("replay_us"), "kernels": row.get("kernels"),
                               "busy_us": row.get("busy_us"), "tokens": tokens[0]}
        print(tag, mode, b, round(row["decode_tok_s"]), row.get("replay_us"), row.get("kernels"), row.get("busy_us"), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"{tag}.json"), "w"))
