"""What gets timed: a training step, prefill, cached and uncached decoding, generation.

Each class owns one scheme's model and inputs, so the orchestrator (run.py) can hold every
scheme at once and interleave their measurements. Inputs are random tokens: speed does not
depend on the values, and random data needs no prepared corpus.
"""

from __future__ import annotations

import torch

from qkvlab.bench.timing import autocast, synchronize, time_it
from qkvlab.model import GPT, ModelConfig
from qkvlab.model.generate import compiled_forward, generate
from qkvlab.run.config import OptimConfig
from qkvlab.train.optim import build_optimizer


def random_tokens(cfg: ModelConfig, batch_size: int, length: int, device: torch.device,
                  seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch_size, length), generator=gen).to(device)


class TrainBench:
    """One scheme's training step: forward + backward + grad clip + AdamW, like a real run."""

    def __init__(self, cfg: ModelConfig, batch_size: int, device: torch.device,
                 dtype: torch.dtype, compile: bool, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.model = GPT(cfg).to(device)
        self.model.train()
        # fullgraph: a graph break (say, from the projection switch) would silently split the
        # compiled model and slow it down; failing loudly is better for a benchmark.
        self.forward = torch.compile(self.model, fullgraph=True) if compile else self.model
        # the trainer's optimizer with its defaults (the paper's AdamW: betas 0.9/0.95, decay
        # on matrices only, fused kernel where torch has one), so a step costs what it costs
        # in `qkvlab train`
        self.optim_cfg = OptimConfig()
        self.opt = build_optimizer(self.model, self.optim_cfg)
        # fp32 master weights under bf16 autocast, as in training; the tokens after the window
        # are the targets.
        data = random_tokens(cfg, batch_size, cfg.block_size + 1, device, seed)
        self.x, self.y = data[:, :-1], data[:, 1:]
        self.tokens_per_step = batch_size * cfg.block_size

    def step(self) -> None:
        with autocast(self.device, self.dtype):
            _, loss = self.forward(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def time_steps(self, steps: int) -> float:
        """Seconds per step over `steps` consecutive steps."""
        return time_it(self.step, self.device, steps)


class InferenceBench:
    """One scheme's model in the inference dtype (bf16 weights, not autocast), no grad.

    With compile, every workload (prefill, both decoders, generate) runs the model through
    generate.compiled_forward: one dynamic-shape graph per kind of call, so a new cache length
    is not a recompile; the warm-up pays the compile, the timed repeats do not. no_grad, not
    inference_mode, as in generate(): mixing the two would compile every graph twice.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, device: torch.device,
                 dtype: torch.dtype, compile: bool = False, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg, self.device, self.batch_size = cfg, device, batch_size
        self.compile = compile
        self.model = GPT(cfg).to(device=device, dtype=dtype).eval()
        self.forward = compiled_forward(self.model) if compile else self.model
        self.cache = self.model.new_cache(batch_size)
        self.prompt = random_tokens(cfg, batch_size, cfg.block_size, device, seed + 1)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of cached keys and values per token per sequence, all layers."""
        return self.cache.bytes_per_token()

    @torch.no_grad()
    def prefill(self, context: int) -> float:
        """Seconds for one forward over `context` prompt tokens that fills the KV cache."""
        idx = self.prompt[:, :context]
        return time_it(lambda: self.forward(idx, cache=self.cache, last_only=True), self.device)

    @torch.no_grad()
    def decode_cached(self, context: int, new_tokens: int) -> float:
        """Seconds per decoding step with the cache, for the steps that end at `context`.

        The prompt of context - new_tokens tokens is prefilled first (not timed); each step
        then feeds one token per sequence and reads every earlier key and value from the cache.
        """
        start = context - new_tokens
        self.forward(self.prompt[:, :start], cache=self.cache, last_only=True)
        tok = self.prompt[:, start:start + 1]
        synchronize(self.device)

        def run() -> None:
            nonlocal tok
            for pos in range(start, context):
                logits, _ = self.forward(tok, cache=self.cache, start_pos=pos, last_only=True)
                tok = logits[:, -1].argmax(dim=-1, keepdim=True)  # greedy: no host sync

        return time_it(run, self.device) / new_tokens

    @torch.no_grad()
    def decode_recompute(self, context: int, new_tokens: int) -> float:
        """Seconds per decoding step without a cache: every step reruns the whole prefix."""
        start = context - new_tokens
        block = self.cfg.block_size

        def run() -> None:
            idx = self.prompt[:, :start]
            for _ in range(new_tokens):
                logits, _ = self.forward(idx[:, -block:], last_only=True)
                idx = torch.cat((idx, logits[:, -1].argmax(dim=-1, keepdim=True)), dim=1)

        return time_it(run, self.device) / new_tokens

    def generate(self, new_tokens: int, use_cache: bool, prompt_len: int = 1) -> float:
        """Seconds for model.generate to add `new_tokens` tokens (greedy) to a short prompt.

        This is the user-facing path. The bench sizes block_size to hold every new token, so
        the cached run never slides its window and the uncached one recomputes the whole prefix.
        """
        prompt = self.prompt[:, :prompt_len]
        return time_it(lambda: generate(self.model, prompt, new_tokens, temperature=0.0,
                                        use_cache=use_cache, compile=self.compile), self.device)
