"""A stand-in for the vLLM generation server on the CPU: vllm_serve.py's protocol server (the same HTTP endpoints, the
same command queue) over an engine that generates with transformers and joins the weight-update group over gloo.

    python tests/vllm_standin_server.py --model FOLDER --port P [--dump_dir DIR]

It samples with the project's HF sampler (utils.core.rollout.generate_completions: stop ids, suppressed tokens from
`allowed_token_ids`, temperature / top-k / top-p) and returns the log-probs of the sampled tokens at the request's
temperature, computed as the trainer computes them (so a trainer whose pushed weights arrived sees a gap of 0).
With --dump_dir it records what it was asked (requests.jsonl: prompts, images per prompt, sampling) and, at every
/reset_prefix_cache/ (the end of a round of weight updates), all its weights (sync-<k>.safetensors, k = 0, 1, ...):
the tests compare those with the trainer's checkpoints."""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from utils.core.logprobs import CompletionLogProbs  # noqa: E402
from utils.core.models import image_token_id, load_model_and_processor  # noqa: E402
from utils.core.rollout import generate_completions, stop_token_ids  # noqa: E402
from utils.core.vllm_client import GlooGroup, decode_image, torch_dtype  # noqa: E402
from vllm_serve import ProtocolServer  # noqa: E402


class HFEngine:
    world_size = 1

    def __init__(self, model_path, *, bind_host="127.0.0.1", dump_dir=None, seed=0):
        self.model, self.processor = load_model_and_processor(model_path)
        self.model.eval().requires_grad_(False)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.scorer = CompletionLogProbs(self.model)
        self.params = dict(self.model.named_parameters())
        self.bind_host, self.dump_dir, self.seed = bind_host, dump_dir, seed
        self.group = self.client_rank = None
        self.calls, self.syncs = 0, 0
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)

    def batch(self, rows, images):
        """Left-padded model inputs for prompt token ids whose image placeholders are already expanded."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        batch = {"input_ids": ids, "attention_mask": mask}
        flat = [im for imgs in images for im in (imgs or [])]
        if flat:
            batch.update(self.processor.image_processor(images=flat, return_tensors="pt"))
            if "mm_token_type_ids" in getattr(self.processor, "model_input_names", ()):
                batch["mm_token_type_ids"] = (ids == image_token_id(self.processor)).long()
        return batch

    @torch.no_grad()
    def generate(self, request):
        n, rows = request["n"], request["prompts"]
        if not isinstance(rows[0], list):
            rows = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
        images = [[decode_image(im) for im in imgs] if imgs else [] for imgs in
                  (request["images"] or [None] * len(rows))]
        extra = request["generation_kwargs"]
        stop = extra.get("stop_token_ids") or stop_token_ids(self.model, self.tokenizer)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        allowed = extra.get("allowed_token_ids")
        suppress = sorted(set(range(vocab)) - set(allowed)) if allowed is not None else []
        expanded = [k for k in range(len(rows)) for _ in range(n)]
        batch = self.batch([rows[k] for k in expanded], [images[k] for k in expanded])
        seeds = torch.tensor([self.seed * 1_000_003 + self.calls * 100_003 + j for j in range(len(expanded))])
        self.calls += 1
        top_k = request["top_k"] if request["top_k"] and request["top_k"] > 0 else None
        ids, mask = generate_completions(
            self.model, batch, row_seeds=seeds, max_new_tokens=request["max_tokens"],
            temperature=request["temperature"], top_k=top_k, top_p=request["top_p"], eos_token_id=stop,
            pad_token_id=self.tokenizer.pad_token_id, suppress_token_ids=suppress)
        logps = self.scorer(batch, ids, mask, request["temperature"])
        completions = [c[m.bool()].tolist() for c, m in zip(ids, mask)]
        scores = [lp[m.bool()].tolist() for lp, m in zip(logps, mask)]
        self.record(dict(call=self.calls, prompts=len(rows), n=n, images=[len(i) for i in images],
                         temperature=request["temperature"], max_tokens=request["max_tokens"],
                         top_p=request["top_p"], top_k=request["top_k"], stop_token_ids=list(stop),
                         suppressed=len(suppress), keys=sorted(extra)))
        return dict(prompt_ids=[list(r) for r in rows], completion_ids=completions,
                    logprobs=[[[lp] for lp in s] for s in scores] if request["logprobs"] is not None else None,
                    logprob_token_ids=[[[t] for t in c] for c in completions])

    def init_communicator(self, host, port, world_size, client_device_uuid):
        # rank 0 holds the store: on loopback here (the request's 0.0.0.0 would listen on every interface)
        self.group = GlooGroup(self.bind_host, port, 0, world_size, timeout=120.0)
        self.client_rank = world_size - 1

    def update_named_param(self, name, dtype, shape):
        weight = torch.empty(tuple(shape), dtype=torch_dtype(dtype))
        self.group.broadcast(weight, src=self.client_rank)
        self.group.barrier()
        if name not in self.params:
            raise KeyError(f"no parameter {name!r} in the served model")
        self.params[name].data.copy_(weight)

    def reset_prefix_cache(self):
        if self.dump_dir:
            state = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
            save_file(state, os.path.join(self.dump_dir, f"sync-{self.syncs}.safetensors"))
        self.syncs += 1

    def close_communicator(self):
        self.group = None

    def record(self, row):
        if self.dump_dir:
            with open(os.path.join(self.dump_dir, "requests.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dump_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = HFEngine(args.model, bind_host=args.host, dump_dir=args.dump_dir, seed=args.seed)
    server = ProtocolServer(engine, args.host, args.port)
    print(f"serving on http://{args.host}:{server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
