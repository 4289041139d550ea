"""The step loop: ONE running batch that rows join and leave at every decoding step (continuous batching). `generate`,
`generate_batched` and `causal-adapter serve` all run on it.

    loop = StepLoop(model, max_rows=32, prefix_cache=PrefixCache())
    loop.add([Row(ids, values, group, max_new_tokens=16), ...])    # they join at the next step
    while loop.busy:
        stepped, finished = loop.step()                         # rows that wrote a token, rows that are done

A step is five named steps:

1. `_join`: the waiting rows that fit (`max_rows`) are prefilled together: one backbone pass over their prompts, left
   padded (a prefix the `PrefixCache` holds is read, not recomputed), whose cache is merged into the batch's
   (`cache.merge_rows`): the new rows' decode rows join the others'. A fork (a horizon's lanes: `add(fork=True)`) is
   one prompt's prefill made the cache of its rows (`cache.fork_rows`).
2. `_decide`: per group (adapter + decoding options + generator), the heads on each row's last hidden state z and the
   mode's choice (`choose`), the number layout (`place`), the values as written (`record`); one copy to the host. A
   row's forced token (`Row.forced`: a lane's continuation, its values) is written as given, its value the head's.
3. per row: the step recorded and the stop checked (`stop`): eos, a stop string, its max_new_tokens, a lane's values, a
   cancel; a row
   whose hidden state or written value is not finite (`record.faults`) writes nothing more and ends with its
   `stop_reason` (`stop.stop_on_fault`): nothing that is not finite is fed back, and the other rows go on.
4. `_leave`: finished rows leave at once: their cache rows are dropped (`cache.select_rows`) and the padding every
   row left has in common is cut (`cache.trim_left`).
5. `_feed`: the tokens and values of the rows that stay go through the backbone together, one position each
   (inputs_embeds = embed + phi(value): a written number is fed back), with each row's attention mask and position.

Each row keeps its own adapter (rows of several adapters share the backbone's pass: peft's mixed batch, the
`adapter_names` of its LoRA layers; each row's embedding phi, heads and number layout its own adapter's), its value
window, its draws and its stop strings. A row's attention never sees another row's positions, and its left padding
is masked, so its output is what it gets alone: the same tokens, values equal to the float rounding another batch
shape brings. A cache whose layers cannot be padded (`cache.movable`) runs as one batch: rows join when it is empty
and leave together (`fixed_reason` says why).
"""
from __future__ import annotations

import logging
from collections import deque

import torch
from torch import Tensor

from ..._compat import cache_kwargs, output_cache
from ...numbers import pad_batch
from ..heads import full_precision, linear_in_dtype
from .adapters import embed_rows, lora_rows, tuner_layers, use_adapter
from .cache import (PrefixCache, cache_from, fork_rows, key_value_only, left_pad, merge_rows, movable, select_rows,
                    trim_left)
from .choose import approximate_product, choose, draw_eps, heads, reads_vocabulary_product
from .prepare import Group, prepare
from .record import (Row, append_step, counted_rows, faults, forced_tokens, push_recent, read_series, recent_window,
                     with_given_run, write_given, written_values)
from .stop import start_text, stop_after, stop_on_fault

log = logging.getLogger("causal_adapter.generation")
#: `StepLoop.add(fork=True)`'s mark in the queue
FORK = "fork"


class StepLoop:
    """The running batch of `model` (a CausalModel): at most `max_rows` rows (None: no cap); `prefix_cache` reuses
    the keys and values of prompt prefixes (key/value caches only). join_running=False: rows join only an empty batch
    (batch after batch, as a server that batches per tick: `causal-adapter serve --scheduler tick`)."""

    def __init__(self, model, *, max_rows: int | None = None, prefix_cache: PrefixCache | None = None,
                 join_running: bool = True):
        self.model, self.max_rows, self.prefix, self.join_running = model, max_rows, prefix_cache, join_running
        self.rows: list[Row] = []  # the batch, in cache order
        self.waiting: deque[tuple[list[Row], tuple | None]] = deque()
        self.cache = self.mask = self.pos = self.z = None  # backbone state: cache, mask [B, L], position [B, 1], z [B, H]
        self.prev = self.pending = self.recent = self.shared = None  # per row, on the heads' device
        self.fixed_reason: str | None = None  # why rows cannot join a running batch (None: they can)
        self.kv_only = False
        self.scorers: dict = {}
        self._lora = None
        self._next: tuple[Tensor, Tensor] | None = None  # the tokens and values `feed` passes to the backbone
        self.prefills = self.prefill_tokens = self.reused_tokens = 0

    # ------------------------------------------------------------------ the caller's side
    def add(self, rows: list[Row], batch: tuple[Tensor, Tensor, Tensor] | None = None, fork: bool = False) -> None:
        """Queue rows; they join at a next step. `batch`: their prompts already padded (input_ids, numeric_values,
        attention_mask [B, S], `generate`'s inputs as given): they join together, prefilled from it. fork: the rows
        share the first one's prompt (a horizon's lanes): they join together, from one prefill (`cache.fork_rows`),
        and take one row of max_rows."""
        if batch is not None or fork:
            self.waiting.append((list(rows), FORK if fork else batch))
        else:
            self.waiting.extend(([r], None) for r in rows)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def waiting_rows(self) -> int:
        return sum(len(unit) for unit, _ in self.waiting)

    def uses_adapter(self, name: str) -> bool:
        return any(r.group.adapter == name for r in self.rows) or any(
            r.group.adapter == name for unit, _ in self.waiting for r in unit)

    def forget_adapters(self) -> None:
        """An adapter was loaded or unloaded: drop what was computed with the adapters as they were."""
        self.scorers.clear()
        self._lora = None
        if self.prefix is not None:
            self.prefix.forget()

    def step(self) -> tuple[list[Row], list[Row]]:
        """One decoding step: (rows that wrote a token, rows that are done now: finished, at their limit, cancelled)."""
        out = self.decide()
        self.feed()
        return out

    def decide(self) -> tuple[list[Row], list[Row]]:
        """The first half of a step (join, decide, record, stop, leave): every row's token is known when it returns,
        so a server can send it before `feed` runs the backbone for the next step."""
        self.feed()  # the previous step's, if the caller did not run it
        self._join()
        if not self.rows:
            return [], []
        for r in self.rows:
            if r.cancelled:
                r.done = True
        stepped = [r for r in self.rows if not r.done]
        tok, fed = self._decide()
        keep = self._leave()
        if keep is not None and any(not r.done for r in self.rows):
            tok, fed = (tok[keep], fed[keep]) if len(keep) != tok.shape[0] else (tok, fed)
            tok, fed, self.recent = with_given_run(self.rows, tok, fed, self.recent, self.model.num_token_id)
            self.prev = tok if tok.dim() == 1 else tok[:, -1]
            self._next = (tok, fed)
        return stepped, [r for r in stepped if r.done]

    def feed(self) -> None:
        """The second half of a step: the rows that stay get their next hidden state (one backbone pass)."""
        if self._next is not None:
            tok, fed = self._next
            self._next = None
            self._feed(tok, fed)

    # ------------------------------------------------------------------ 1. join
    def _join(self) -> None:
        while self.waiting and all(r.cancelled for r in self.waiting[0][0]):
            for r in self.waiting.popleft()[0]:
                r.done = True
        if not self.waiting or (self.rows and (self.fixed_reason is not None or not self.join_running)):
            return
        free = float("inf") if self.max_rows is None else self.max_rows - counted_rows(self.rows)
        take, batch = [], None
        while self.waiting:
            unit, given = self.waiting[0]
            if given is FORK:
                if not take and (counted_rows(unit) <= free or not self.rows):
                    take, batch = unit, FORK
                    self.waiting.popleft()
                break
            if given is not None:
                if not take:
                    take, batch = unit, given
                    self.waiting.popleft()
                break
            if unit[0].cancelled:
                unit[0].done = True
                self.waiting.popleft()
                continue
            if len(take) + len(unit) > free or not self._compatible(unit[0], take):
                break
            take += unit
            self.waiting.popleft()
        if take:
            self._prefill(take, batch)

    def _exclusive(self, adapter: str | None) -> bool:
        """LoRA on MoE expert parameters (`target_parameters`): peft cannot mix it with other adapters in a batch."""
        lora = None if adapter is None else self.model.causal_configs[adapter].lora
        return lora is not None and bool(lora.target_parameters)

    def _compatible(self, row: Row, taking: list[Row]) -> bool:
        present = {r.group.adapter for r in self.rows} | {r.group.adapter for r in taking}
        if not present or present == {row.group.adapter}:
            return True
        return not self._exclusive(row.group.adapter) and not any(self._exclusive(a) for a in present)

    def _prefill(self, rows: list[Row], batch) -> None:
        model = self.model
        for g in dict.fromkeys(r.group for r in rows):
            if g.settings is None:
                self._use_adapter(g.adapter)
                g.settings = prepare(model, g, self.scorers)
        dev = model.input_device
        lanes = rows
        # one prefill for the lanes of one prompt, never from the prefix cache: a horizon's figures are the same
        # whatever was asked before (in the server as in `predict_horizon`)
        prefix = self.prefix if batch is not FORK else None
        if batch is FORK:
            rows, batch = rows[:1], None
        hits = [(0, [])] * len(rows)
        if batch is None and prefix is not None and self.kv_only:
            hits = [self.prefix.lookup(self._prefix_key(r), r.ids, r.values) for r in rows]
        if batch is not None:
            ids, values, mask = batch
            cache = None
            position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        else:
            ids, values, mask, position_ids, cache = self._prompt_inputs(rows, hits, dev)
        with self._lora_rows([r.group.adapter for r in rows]):
            out = model.decoder(inputs_embeds=self._embed(rows, ids, values), attention_mask=mask,
                                position_ids=position_ids, use_cache=True,
                                **({} if cache is None else cache_kwargs(model.decoder, cache)))
        new_cache = output_cache(out)
        for r in rows:
            read_series(r)
        self.prefills += 1
        self.prefill_tokens += sum(len(r.ids) - n for r, (n, _) in zip(rows, hits))
        self.reused_tokens += sum(n for n, _ in hits)
        for r, (n, _) in zip(rows, hits):
            r.reused_tokens = n
        if not self.rows:
            self.fixed_reason, self.kv_only = movable(new_cache), key_value_only(new_cache)
            if self.fixed_reason is not None and self.max_rows is not None:
                log.info("rows join a running batch only when it is empty: %s", self.fixed_reason)
        if prefix is not None and self.kv_only and batch is None:
            self._store_prefixes(rows, hits, new_cache, mask)
        z = out.last_hidden_state[:, -1]
        if lanes is not rows:
            n = len(lanes)
            fork_rows(new_cache, n)
            mask, position_ids, z = mask.expand(n, -1), position_ids.expand(n, -1), z.expand(n, -1)
            for r in lanes[1:]:
                r.floored, r.series_scale, r.reused_tokens = rows[0].floored, rows[0].series_scale, hits[0][0]
                r.ar = rows[0].ar
        self._merge(lanes, new_cache, mask, position_ids[:, -1:], z)

    def _prompt_inputs(self, rows: list[Row], hits, dev):
        """The new rows' prompts left padded, after the prefix each one reads from the prefix cache: (ids, values,
        mask, position ids, a cache holding those prefixes or None)."""
        P = max(n for n, _ in hits)
        wide = any(r.group.values_dtype == torch.float64 for r in rows)
        enc = pad_batch([r.ids[n:] for r, (n, _) in zip(rows, hits)], [r.values[n:] for r, (n, _) in zip(rows, hits)],
                        rows[0].group.settings.pad_id, padding_side="left", return_tensors=None)
        ids = torch.tensor(enc["input_ids"], dtype=torch.long, device=dev)
        mask = torch.tensor(enc["attention_mask"], dtype=torch.long, device=dev)
        values = torch.tensor(enc["numeric_values"], dtype=torch.float64 if wide else torch.float32, device=dev)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if P == 0:
            return ids, values, mask, position_ids, None
        reused = torch.tensor([[n] for n, _ in hits], device=dev)
        position_ids = (position_ids + reused).masked_fill(mask == 0, 0)
        head = (torch.arange(P, device=dev).unsqueeze(0) >= P - reused).long()  # each prefix right-aligned
        layers = []
        template = next(layers for n, layers in hits if n)
        for i, (k0, v0) in enumerate(template):
            k = k0.new_zeros((len(rows), k0.shape[0], P, k0.shape[-1]))
            v = v0.new_zeros((len(rows), v0.shape[0], P, v0.shape[-1]))
            for b, (n, kv) in enumerate(hits):
                if n:
                    k[b, :, P - n:], v[b, :, P - n:] = kv[i]
            layers.append((k, v))
        return ids, values, torch.cat([head, mask], 1), position_ids, cache_from(layers)

    def _store_prefixes(self, rows: list[Row], hits, cache, mask: Tensor) -> None:
        """Keep the new rows' prompt blocks: a row's positions are its prefix read from the cache (right-aligned in the
        first P columns) and its suffix (right-aligned in the rest), two slices copied once."""
        P = max(n for n, _ in hits)
        L = mask.shape[1]
        for b, (r, (n, _)) in enumerate(zip(rows, hits)):
            if len(r.ids) - 1 < self.prefix.block * (n // self.prefix.block + 1):
                continue  # no new whole block
            rest = len(r.ids) - n

            def own(t: Tensor) -> Tensor:
                return torch.cat([t[b, :, P - n:P], t[b, :, L - rest:]], 1) if n else t[b, :, L - rest:].clone()

            self.prefix.store(self._prefix_key(r), r.ids, r.values,
                              [(own(layer.keys), own(layer.values)) for layer in cache.layers], start=n)

    def _prefix_key(self, row: Row) -> tuple:
        """What besides the tokens changes a prompt's keys: its adapter's LoRA (None: none), the adapter (from the first
        number on), the <NUM> id (`PrefixCache`)."""
        adapter = row.group.adapter
        config = self.model.causal_config if adapter is None else self.model.causal_configs[adapter]
        name = adapter if adapter is not None else getattr(self.model, "active_adapter", None)
        return (name if config.lora is not None else None, name, self.model.num_token_id)

    def _merge(self, rows: list[Row], cache, mask: Tensor, pos: Tensor, z: Tensor) -> None:
        """The prefilled rows join the batch: cache, mask, positions, z and each row's decoding state."""
        model = self.model
        hdev = model.device
        prev = torch.tensor([r.ids[-1] for r in rows], dtype=torch.long, device=hdev)
        pending = torch.zeros(len(rows), dtype=torch.bool, device=hdev)
        k_old = 0 if self.recent is None else self.recent.shape[1]
        k = max([k_old] + [r.group.settings.recent_k for r in self.rows + rows])
        shared = self._shared_eps(rows)
        if not self.rows:
            self.cache, self.mask, self.pos, self.z = cache, mask, pos, z
            self.prev, self.pending, self.shared = prev, pending, shared
            self.recent = self._windows(rows, k)
        else:
            merge_rows(self.cache, cache)
            L = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([left_pad(self.mask, L, -1), left_pad(mask, L, -1)])
            self.pos, self.z = torch.cat([self.pos, pos]), torch.cat([self.z, z])
            self.prev, self.pending = torch.cat([self.prev, prev]), torch.cat([self.pending, pending])
            if k != k_old:  # a row whose value head reads more numbers joined: every window read again
                self.recent = self._windows(self.rows, k)
            self.recent = torch.cat([self.recent, self._windows(rows, k)])
            if shared is not None or self.shared is not None:
                C = (shared if shared is not None else self.shared).shape[1]
                old = self.shared if self.shared is not None else z.new_zeros(len(self.rows), C)
                new = shared if shared is not None else z.new_zeros(len(rows), C)
                self.shared = torch.cat([old.to(new.dtype), new])
        for r in rows:
            start_text(r, r.group.ntok)
        self.rows += rows

    def _windows(self, rows: list[Row], k: int) -> Tensor:
        num = self.model.num_token_id
        return torch.tensor([recent_window(r.ids + r.tokens, r.values + r.fed_values, num, k) for r in rows],
                            dtype=torch.float64, device=self.model.device).reshape(len(rows), k)

    def _shared_eps(self, rows: list[Row]) -> Tensor | None:
        """[n, C] the eps each new row keeps for the whole generation (causal mode, shared_individual), drawn group by
        group in order of first appearance: a group of fixed slots draws all its slots at once."""
        groups = [g for g in dict.fromkeys(r.group for r in rows) if g.opts.mode == "causal" and g.opts.shared_individual]
        if not groups:
            return None
        per_row = {}
        for g in groups:
            s = g.settings
            mine = [r for r in rows if r.group is g]
            if g.fixed_slots:
                if g.shared_eps is None:
                    g.shared_eps = draw_eps(g.slots, s.C, s.hdtype, s.hdev, g.gen)
                eps = g.shared_eps[torch.tensor([r.slot for r in mine], device=s.hdev)]
            else:
                eps = draw_eps(len(mine), s.C, s.hdtype, s.hdev, g.gen)
            per_row.update(zip(mine, eps))
        C, ref = groups[0].settings.C, groups[0].settings
        zero = torch.zeros(C, dtype=ref.hdtype, device=ref.hdev)
        return torch.stack([per_row.get(r, zero) for r in rows])

    # ------------------------------------------------------------------ 2-3. decide, record, stop
    def _decide(self) -> tuple[Tensor, Tensor]:
        """Every row not done chooses its token; returns (token [B], value fed back [B]) of the whole batch (a done row
        that stays: pad, 0)."""
        model, rows = self.model, self.rows
        B, hdev = len(rows), model.device
        groups: dict[Group, list[int]] = {}
        known: list[int] = []  # rows whose next token and value are given (a lane's continuation): nothing to choose
        forcing: set[Group] = set()  # groups with a row whose next token is given (a lane's value: the head writes it)
        feed_dtype = torch.float32
        for i, r in enumerate(rows):
            if r.done:
                continue
            feed_dtype = torch.promote_types(feed_dtype, r.group.vdtype)
            f = r.forced_next()
            if f is not None and f[1] is not None:
                known.append(i)
                continue
            groups.setdefault(r.group, []).append(i)
            if f is not None:
                forcing.add(r.group)
        tok = torch.tensor([r.group.settings.pad_id for r in rows], dtype=torch.long, device=hdev)
        fed = torch.zeros(B, dtype=feed_dtype, device=hdev)
        host = torch.zeros(6, B, dtype=torch.float64, device=hdev)  # written, exact, P_k, loc_Y, scale_Y, fault
        pending = torch.zeros(B, dtype=torch.bool, device=hdev)
        eps = {}
        index = {g: (None if len(at) == B else torch.tensor(at, device=hdev)) for g, at in groups.items()}

        def take(g: Group, t: Tensor | None) -> Tensor | None:
            return t if t is None or index[g] is None else t[index[g].to(t.device)]

        done, vocab = self._heads(groups, take, forcing)
        for g, at in groups.items():
            if g not in done:
                self._use_adapter(g.adapter)
            mine = [rows[i] for i in at]
            with full_precision(self.z.device):  # the heads as in forward, whatever autocast is active
                c = choose(model, g, take(g, self.z), prev=take(g, self.prev), pending=take(g, self.pending),
                           recent=take(g, self.recent) if g.settings.recent_k else None,
                           steps=torch.tensor([len(r.tokens) for r in mine]) if g.opts.min_new_tokens else None,
                           slots=torch.tensor([r.slot for r in mine], device=hdev) if g.fixed_slots else None,
                           shared_eps=take(g, self.shared), history=lambda: _history(mine), done=done.get(g),
                           vocab=vocab.get(g), floored=torch.tensor([r.floored for r in mine], device=hdev),
                           log=torch.tensor([r.log for r in mine], device=hdev), ars=[r.ar for r in mine],
                           forced=forced_tokens(mine, hdev) if g in forcing else None)
            exact, written = written_values(g, c.tok, c.val)
            fault = faults(take(g, self.z), c.tok, written.to(feed_dtype), c.writable, g.settings.num_id)
            at_t = slice(None) if index[g] is None else index[g]
            # a faulty row writes nothing more: its token is the pad, its value 0 (never fed back), and it leaves
            tok[at_t] = torch.where(fault > 0, g.settings.pad_id, c.tok)
            fed[at_t] = torch.where(fault > 0, 0.0, written.to(feed_dtype))
            pending[at_t] = c.pending & (fault == 0)
            hd = g.settings.hdtype
            host[:, at_t] = torch.stack([written.double(), exact.double(), c.prob.to(hd).double(),
                                         c.loc_Y.to(hd).double(), c.scale_Y.to(hd).double(), fault.double()])
            if g.opts.return_eps:
                eps.update(zip(mine, c.eps.to(g.settings.device)))
        if known:
            write_given([self.rows[i] for i in known], known, self.z, tok, fed, host, pending)
        self.prev, self.pending = tok, pending
        if self.recent is not None and self.recent.shape[1]:
            self.recent = push_recent(self.recent, tok, fed, model.num_token_id)
        values = torch.cat([tok.double().unsqueeze(0), host]).cpu().tolist()  # the step's one copy to the host
        for i, r in enumerate(rows):
            if r.done:
                continue
            t = int(values[0][i])
            if values[6][i]:
                stop_on_fault(r, int(values[6][i]), values[4][i], values[5][i])
                continue
            append_step(r, t, values[1][i], values[2][i], values[3][i], values[4][i], values[5][i], eps.get(r))
            stop_after(r, t, values[1][i], r.group.settings.eos_set)
        return tok, fed

    def _heads(self, groups: dict, take, forcing: set) -> tuple[dict, dict]:
        """With rows of several adapters whose choice starts from W_cls loc_U: every group's heads first (its adapter
        active), then ONE product with W_cls (the base's lm_head, shared) for all their rows: a step reads the
        vocabulary once, not once per adapter (once per kind: the float32 product, the bf16 one of the deterministic
        mode where it is cheap). Returns ({group: Heads}, {group: its rows' W_cls loc_U}). Groups in `forcing` (a
        lane's token given) read no product."""
        done, vocab = {}, {}
        reading = [g for g in groups if reads_vocabulary_product(g) and g not in forcing]
        for approx in (False, True):
            shared = [g for g in reading if approximate_product(g) == approx]
            if len(shared) < 2 or len({g.settings.hdtype for g in shared}) > 1:
                continue
            for g in shared:
                self._use_adapter(g.adapter)
                with full_precision(self.z.device):
                    done[g] = heads(self.model, g, take(g, self.z),
                                    take(g, self.recent) if g.settings.recent_k else None,
                                    torch.tensor([self.rows[i].log for i in groups[g]]),
                                    [self.rows[i].ar for i in groups[g]])
            with full_precision(self.z.device):
                loc_U = torch.cat([done[g].loc_U for g in shared])
                product = shared[0].settings.scorer.approx_vocab(loc_U) if approx else \
                    linear_in_dtype(loc_U, self.model.W_cls)
            vocab.update(zip(shared, product.split([done[g].loc_U.shape[0] for g in shared])))
        return done, vocab

    # ------------------------------------------------------------------ 4. leave
    def _leave(self) -> Tensor | None:
        """Drop the done rows; returns the batch indices that stay (None: none stays)."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if not keep:
            self.rows, self.cache = [], None
            self.mask = self.pos = self.z = self.prev = self.pending = self.recent = self.shared = None
            return None
        if len(keep) == len(self.rows) or self.fixed_reason is not None:
            return torch.arange(len(self.rows), device=self.model.device)
        at = torch.tensor(keep, device=self.model.device)
        select_rows(self.cache, at)
        dev = self.mask.device
        self.mask, self.pos = self.mask[at.to(dev)], self.pos[at.to(dev)]
        self.prev, self.pending = self.prev[at], self.pending[at]
        self.recent = None if self.recent is None else self.recent[at]
        self.shared = None if self.shared is None else self.shared[at]
        self.rows = [self.rows[i] for i in keep]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns no row attends to
        if unused:
            self.mask = self.mask[:, unused:]
            trim_left(self.cache, unused)
        return at

    # ------------------------------------------------------------------ 5. feed
    def _feed(self, tok: Tensor, fed: Tensor) -> None:
        """tok / fed [B] (or [B, s]: a step's token and the tokens given after it) through the backbone."""
        model, dev, (tok, fed) = self.model, self.model.input_device, (t.reshape(len(self.rows), -1) for t in (tok, fed))
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), tok.shape[1])], 1)
        pos = self.pos + torch.arange(1, tok.shape[1] + 1, device=self.pos.device)
        self.pos = pos[:, -1:]
        with self._lora_rows([r.group.adapter for r in self.rows]):
            out = model.decoder(inputs_embeds=self._embed(self.rows, tok.to(dev), fed.to(dev)),
                                attention_mask=self.mask, position_ids=pos, use_cache=True,
                                **cache_kwargs(model.decoder, self.cache))
        self.z = out.last_hidden_state[:, -1]

    # ------------------------------------------------------------------ adapters
    def _use_adapter(self, adapter: str | None) -> None:
        use_adapter(self.model, adapter)

    def _embed(self, rows: list[Row], ids: Tensor, values: Tensor) -> Tensor:
        return embed_rows(self.model, [r.group.adapter for r in rows], ids, values)

    def _lora_rows(self, names: list[str | None]):
        key = tuple(self.model.adapter_names)
        if self._lora is None or self._lora[0] != key:  # the LoRA layers change when an adapter is loaded
            self._lora = (key, tuner_layers(self.model))
        return lora_rows(self._lora[1], names)


def _history(rows: list[Row]) -> Tensor:
    """[n, L] each row's tokens (prompt and written), left padded: with the row's first token for the repetition
    penalty (the same set of tokens as the row alone), else with the pad id."""
    s = rows[0].group.settings
    first = any(getattr(w, "pads_with_first_token", False) for w in s.warpers or ())
    seqs = [r.ids + r.tokens for r in rows]
    L = max(len(q) for q in seqs)
    return torch.tensor([[q[0] if first else s.pad_id] * (L - len(q)) + q for q in seqs], dtype=torch.long)
