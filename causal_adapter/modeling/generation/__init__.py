"""Text generation with the causal heads (SPEC section 4), on the backbone's KV cache: one engine, the step loop.

    generate(model, "prompt with 3 numbers", tokenizer=tok, mode="deterministic")
    model.generate(input_ids=..., numeric_values=..., attention_mask=..., mode="causal", seed=0)
    generate_batched(model, prompts, tokenizer=tok, batch_size=16)

`generate`, `generate_batched` and `causal-adapter serve` run on one step loop (`loop.StepLoop`): a running batch
that rows join and leave at every decoding step. The modules are the steps, in order:

    options  the arguments (transformers' generate arguments, a GenerationConfig) checked against the mode
    prepare  the inputs on the model's device; a Group of rows (one adapter, one set of options, one generator)
             and its Settings (eos / pad ids, devices, the OvR scorer, logits warpers, the number layout)
    loop     the step loop: join (prefill, merge), decide, leave, feed
    cache    the backbone's cache row by row (transformers' DynamicCache), and the prefix cache
    adapters rows of several adapters in one backbone pass (peft's mixed batch)
    choose   choose a token: the heads on each row's last hidden state, the mode's choice
    place    place a number: the number layout of training (a prefix before <NUM>)
    record   record: what each row wrote (Row), values rounded as written, the value head's recent numbers
    stop     stop: eos, stop strings, max_new_tokens, a cancel
    stream   the text as it grows (RowText, NumberStreamer, what a stream may send)
    output   GenerationOutput, built from the rows
    api      generate, generate_batched

Modes: ``softmax`` (loc_S, the base model's logits at initialisation; greedy or sampled), ``deterministic``
(default: argmax of the OvR probabilities P_k) and ``causal`` (an individual U sampled, then the noiseless action;
``shared_individual=True`` keeps one eps per row). Per step the backbone sees only the new position
(``inputs_embeds`` = token embedding + phi(value): a generated number is fed back), with each row's attention mask and
position (``position_ids = cumsum(mask) - 1`` as transformers' own ``generate`` builds them); the heads run on the last
position only. A row stops on an eos id, after the token completing a stop string, or at max_new_tokens; it then
leaves the batch, and its output is padded with ``pad_token_id`` / value 0.
"""
from .api import generate, generate_batched
from .options import MODES, accepted_generate_kwargs
from .output import GenerationOutput
from .prepare import default_eos_ids, text_prompts_tokenizer
from .stream import NumberStreamer

__all__ = ["GenerationOutput", "MODES", "NumberStreamer", "accepted_generate_kwargs", "default_eos_ids", "generate",
           "generate_batched", "text_prompts_tokenizer"]
