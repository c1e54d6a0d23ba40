"""The synchronous engine: requests in, per-step outputs out."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from engine.adapters import LoraAdapter, load_adapter
from engine.batcher import Batcher, StepPlan
from engine.block_manager import BlockManager
from engine.completions import generate
from engine.config import EngineConfig, ModelConfig
from engine.decoding import AnswerGroup, PreparedRequest, answer_id
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.errors import RequestError
from engine.grammar import Grammars
from engine.layers.linear import pack_linear_layers
from engine.layers.lora import attach_adapters
from engine.layers.quantized import quantize_int8
from engine.layers.tied import tie_into_panels
from engine.loader import DTYPES, load_model, load_model_config, load_tokenizer, resolve_dtype
from engine.model_files import model_fingerprint
from engine.model_runner import Executed, ModelRunner, kv_cache_bytes_per_block
from engine.models.llama import LlamaForCausalLM
from engine.outputs import Completion, RequestOutput, TokenLogprob, metrics_of
from engine.prefix_hash import PrefixKey
from engine.sampling import Priority, RequestLimits, SamplingParams
from engine.sequence import SeqStatus, Sequence
from engine.tokenizer import Tokenizer

Prompt = str | Seq[int]


class LLMEngine:
    """Continuous-batching inference over one model.

    Not thread-safe: call its methods from one thread.
    `ProcessEngine` runs it in a child process for asyncio code.
    With `config.quantization` set, the model's linear layers are quantized in place; the
    fp32 ones left are packed for their matrix multiply (`pack_linear_layers`), and a tied
    embedding and LM head share one packed matrix, int8 too when quantized
    (`tie_into_panels`).
    `adapters` are LoRA adapters of the model that a request may name; each request runs
    the base model plus its own adapter, in the same batch as the others.
    A request's JSON schema or grammar (SamplingParams) masks the tokens it may draw each
    step; its matcher advances with each token it is given (`grammars` compiles them).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        model_fingerprint: str = "",
        adapters: Seq[LoraAdapter] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or EngineConfig()
        self.model_config: ModelConfig = model.config
        self.config = config
        self.tokenizer = tokenizer
        self.model_fingerprint = model_fingerprint
        self.max_model_len = min(
            config.max_model_len or 1 << 62, self.model_config.max_position_embeddings
        )
        if config.quantization == "int8":
            quantize_int8(model)
        tie_into_panels(model, int8=config.quantization == "int8")
        pack_linear_layers(model)
        lora = attach_adapters(model, adapters) if adapters else None
        # adapter name -> (slot, fingerprint); "" is the base model.
        self.adapters = {"": (0, "")} | {
            a.name: (slot, a.fingerprint) for slot, a in enumerate(adapters, start=1)
        }
        dtype = next(model.parameters()).dtype
        kv_dtype = dtype if config.kv_dtype == "auto" else DTYPES[config.kv_dtype]
        self.kv_dtype = str(kv_dtype).removeprefix("torch.")
        num_blocks = config.num_kv_blocks or max(
            1,
            config.kv_cache_bytes
            // kv_cache_bytes_per_block(self.model_config, config.block_size, kv_dtype),
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.batcher = Batcher(
            self.block_manager,
            config.max_num_batched_tokens,
            min(config.max_num_seqs, config.max_num_batched_tokens),
            watermark_blocks=max(1, num_blocks // 100),
        )
        self.runner = ModelRunner(model, config.block_size, num_blocks, dtype, kv_dtype, lora)
        self.limits = RequestLimits(
            self.model_config.vocab_size, self.max_model_len, num_blocks, config.block_size
        )
        self.grammars = Grammars(tokenizer, self.model_config.vocab_size)
        self._clock = clock
        # By sequence id: a request's id, or with n > 1 its first answer's (the others
        # are `answer_id`s); the requests with n > 1 by their ids.
        self._requests: dict[str, PreparedRequest] = {}
        self._groups: dict[str, AnswerGroup] = {}
        self._pending_outputs: list[RequestOutput] = []
        # The last step's (sequences, tokens): equal for a step of decodes only.
        self.last_step_shape = (0, 0)
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> LLMEngine:
        """Load a Hugging Face model directory; raises ModelLoadError / UnsupportedModelError."""
        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config = load_model_config(model_dir)
        tokenizer = load_tokenizer(model_dir, model_config)
        model = load_model(
            model_dir, model_config, config.block_size, resolve_dtype(config.dtype, model_config)
        )
        adapters = [load_adapter(name, path, model) for name, path in config.adapters]
        fingerprint = model_fingerprint(Path(model_dir))
        return cls(
            model,
            tokenizer,
            config,
            model_fingerprint=fingerprint,
            adapters=adapters,
            clock=clock,
        )

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def has_unfinished_requests(self) -> bool:
        return self.batcher.has_unfinished or bool(self._pending_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_namespace: str = "",
        priority: Priority | str = Priority.INTERACTIVE,
        adapter: str = "",
    ) -> None:
        """Queue a request; `prompt` is text (tokenized with special tokens) or token ids.

        `cache_namespace` is the security domain: prefix-cache blocks are shared only
        between requests of the same namespace (and the same `adapter`, "" for the base
        model). Raises RequestError when invalid.
        """
        request = self._prepare(
            request_id,
            prompt,
            params,
            cache_namespace=cache_namespace,
            priority=priority,
            adapter=adapter,
        )
        self._requests[request_id] = request
        self.batcher.add(request.seq)
        if request.group is not None:
            self._groups[request_id] = request.group

    def _prepare(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None,
        *,
        cache_namespace: str,
        priority: Priority | str,
        adapter: str = "",
    ) -> PreparedRequest:
        """Validate and tokenize the request, and give it its sequence and sampler state."""
        params = params or SamplingParams()
        if request_id in self._requests or request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        if adapter not in self.adapters:
            raise RequestError(f"adapter {adapter!r} is not loaded")
        slot, adapter_fingerprint = self.adapters[adapter]
        token_ids = (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        self.limits.check(token_ids, params)
        arrival_index = next(self._arrivals)
        tenant = cache_namespace
        if params.prompt_logprobs is not None:
            # Its prompt is computed whole, so it shares no prefix with other requests.
            cache_namespace = f"{cache_namespace}\x00{request_id}\x00{arrival_index}"
        cache_root = self._cache_root(cache_namespace, adapter_fingerprint)
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        seed = params.seed if params.seed is not None else self._seeds.randrange(1 << 63)
        answers = []
        for index in range(params.n):
            seq = Sequence(
                answer_id(request_id, index),
                token_ids,
                params,
                priority=Priority.parse(priority),
                tenant=tenant,
                arrival_index=arrival_index,
                cache_root=cache_root,
                arrival_time=self._clock(),
                adapter_slot=slot,
            )
            matcher = (
                self.grammars.matcher(params.json_schema, params.grammar)
                if params.constrained
                else None
            )
            answers.append(
                PreparedRequest(
                    seq=seq,
                    detokenizer=IncrementalDetokenizer(self.tokenizer.decode, token_ids),
                    stops=StopStringMatcher(params.stop),
                    stop_token_ids=frozenset((*params.stop_token_ids, *eos)),
                    generator=torch.Generator().manual_seed((seed + index) % (1 << 64)),
                    matcher=matcher,
                    index=index,
                )
            )
        if params.n > 1:
            group = AnswerGroup(request_id, answers, waiting=answers[1:])
            for answer in answers:
                answer.group = group
        return answers[0]

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; the next `step` reports it
        finished with reason "abort". False if the id is unknown or already finished."""
        group = self._groups.pop(request_id, None)
        answers = group.answers if group is not None else [self._requests.get(request_id)]
        live = [a for a in answers if a is not None and a.seq.request_id in self._requests]
        if group is None and not live:
            return False
        for answer in live:
            answer.seq.account_kv(self._clock())
            self._finish(answer, "abort")
        metrics = group.metrics() if group is not None else metrics_of(live[0].seq)
        self._pending_outputs.append(RequestOutput(request_id, (), "", True, "abort", metrics))
        return True

    def suspend(self, request_id: str) -> bool:
        """Frees a request's blocks and computes nothing of it until `resume`: its tokens
        so far stay, and it is recomputed then like a preempted one. False (and no
        change) if the id is unknown or finished, or the request draws several answers."""
        request = self._requests.get(request_id)
        if request is None or request.group is not None:
            return False
        request.seq.account_kv(self._clock())
        self.batcher.suspend(request.seq)
        return True

    def resume(self, request_id: str) -> bool:
        """Queues a suspended request again; False if it is not suspended."""
        request = self._requests.get(request_id)
        if request is None or request.seq.status is not SeqStatus.SUSPENDED:
            return False
        self.batcher.add(request.seq)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one batched forward pass; return an output for every request that advanced."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self.last_step_shape = (0, 0)
        if not self.batcher.has_unfinished:
            return outputs
        start = self._clock()
        for seq in self.batcher.running:
            seq.account_kv(start)
        plan = self.batcher.schedule()
        for seq in self.batcher.running:
            if seq.kv_clock is None:
                seq.kv_clock = start
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        generators = {
            c.seq.request_id: self._requests[c.seq.request_id].generator for c in plan.chunks
        }
        executed = (
            self.runner.execute(plan, generators, self._masks(plan))
            if plan.chunks
            else Executed([], {})
        )
        self.batcher.on_executed(plan)
        self.last_step_shape = (len(plan.chunks), plan.num_tokens)
        end = self._clock()
        for seq in self.batcher.running:
            seq.account_kv(end)
        for request_id, (first, entries) in executed.scored.items():
            self._requests[request_id].score(first, entries)
        outputs.extend(
            self._on_token(self._requests[seq.request_id], token, logprob, end)
            for seq, token, logprob in executed.sampled
        )
        return outputs

    def _masks(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The grammar bitmask of each request in the plan that samples under a grammar."""
        matchers = {
            c.seq.request_id: matcher
            for c in plan.chunks
            if (matcher := self._requests[c.seq.request_id].matcher) is not None and c.samples
        }
        if not matchers:
            return {}
        bitmask = torch.from_numpy(self.grammars.masks(list(matchers.values())))
        return dict(zip(matchers, bitmask, strict=True))

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run `prompts` to completion (with whatever else is queued); results in prompt order."""
        return generate(self, prompts, params)

    def _on_token(
        self, request: PreparedRequest, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        seq = request.seq
        seq.append_token(token, now)
        text, reason = request.advance(token, self.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        logprobs = () if logprob is None else (logprob,)
        scored = (
            tuple(request.prompt_logprobs)
            if seq.params.prompt_logprobs is not None
            and request.index == 0
            and seq.num_output_tokens == 1
            else ()
        )
        group = request.group
        if group is None:
            return RequestOutput(
                seq.request_id,
                (token,),
                text,
                reason is not None,
                reason,
                metrics_of(seq),
                logprobs=logprobs,
                prompt_logprobs=scored,
            )
        # The prompt is computed: the other answers start, and find it cached.
        for waiting in group.waiting:
            self._requests[waiting.seq.request_id] = waiting
            self.batcher.add(waiting.seq)
        group.waiting = []
        if reason is not None:
            group.num_ended += 1
            if group.ended:
                del self._groups[group.request_id]
        return RequestOutput(
            group.request_id,
            (token,),
            text,
            group.ended,
            reason,
            group.metrics(),
            logprobs=logprobs,
            index=request.index,
            prompt_logprobs=scored,
        )

    def _finish(self, request: PreparedRequest, reason: str) -> None:
        request.seq.finish_reason = reason
        self.batcher.finish(request.seq)
        del self._requests[request.seq.request_id]

    def _cache_root(self, namespace: str, adapter_fingerprint: str) -> bytes:
        key = PrefixKey(
            namespace=namespace,
            model_fingerprint=self.model_fingerprint,
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            template_fingerprint=self.tokenizer.template_fingerprint,
            adapter_fingerprint=adapter_fingerprint,
            kv_dtype=self.kv_dtype,
            block_size=self.config.block_size,
            quantization=self.config.quantization or "",
        )
        return key.root()
