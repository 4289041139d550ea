"""A horizon (`CausalModel.predict_horizon`, `causal-adapter predict --horizon H`, docs/predict.md "A horizon"): step 1
is `predict_values` exactly, the deterministic path feeds each value back and writes the row's continuations between
them, the paths are seeded and share one prefill, the per-step maps `train` fits on validation rows of a forecasting
file are saved and reloaded, and bad input fails before anything is written."""
import contextlib
import csv
import json
import math

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.modeling import horizon as hz
from causal_adapter.numbers import format_number
from causal_adapter.training.value_head.warm_start import fit_value_units

from test_predict import _jsonl, calibrated_adapter

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
PROMPTS = [
    "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: 68.9; 1973: 38; 1974: ",
    "Yearly sunspot numbers. 1975: 15.5; 1976: 12.6; 1977: ",
    "1978: 92.5; 1979: ",
]
CONTS = [["; 1975: ", "; 1976: "], ["; 1978: ", "; 1979: "], ["; 1980: ", "; 1981: "]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, qwen_tokenizer):
    """(adapter dir, loaded model): `test_predict`'s adapter (value units, 1 decimal, a one-step calibration map,
    random w_reg: the paths' u reaches the value)."""
    return calibrated_adapter(tmp_path_factory, qwen_tokenizer, "horizon")


def test_step_one_is_predict_and_the_path_feeds_each_value_back(saved, qwen_tokenizer):
    _, model = saved
    one = model.predict_values(PROMPTS, tokenizer=qwen_tokenizer, batch_size=2)
    out = model.predict_horizon(PROMPTS, tokenizer=qwen_tokenizer, horizon=3, paths=20, continuations=CONTS,
                                batch_size=2, seed=0)
    for a, b in zip(one, out):
        assert {k: b[k] for k in a} == a  # predict's row, bit for bit
        assert [s["step"] for s in b["horizon"]] == [1, 2, 3]
        assert list(b["horizon"][1]) == ["step", "value", "lower_50", "upper_50", "lower_90", "upper_90"]
        first = b["horizon"][0]
        assert first == {"step": 1, "value": a["value"], "lower_50": a["lower_50"], "upper_50": a["upper_50"],
                         "lower_90": a["lower_90"], "upper_90": a["upper_90"]}
        for s in b["horizon"][1:]:
            assert s["lower_90"] <= s["lower_50"] <= s["value"] <= s["upper_50"] <= s["upper_90"]
    h1 = model.predict_horizon(PROMPTS, tokenizer=qwen_tokenizer, horizon=1, batch_size=2)
    assert [r["horizon"] for r in h1] == [r["horizon"][:1] for r in out]  # H = 1: predict's row, no path
    # the deterministic path: value h + 1 is predict's after the text with values 1..h written (as the adapter
    # writes them: value_decimals = 1) and the continuations between them
    for prompt, conts, b in zip(PROMPTS, CONTS, out):
        text = prompt
        for h in range(2):
            text += format_number(round(b["horizon"][h]["value"], 1)) + conts[h]
            ref = model.predict_values([text], tokenizer=qwen_tokenizer)[0]["value"]
            assert b["horizon"][h + 1]["value"] == pytest.approx(ref, rel=1e-4, abs=1e-3)


def test_paths_are_seeded_share_the_prefill_and_deterministic_path_alone(saved, qwen_tokenizer):
    _, model = saved
    kw = dict(tokenizer=qwen_tokenizer, horizon=3, paths=25, continuations=CONTS)
    a = model.predict_horizon(PROMPTS, seed=1, **kw)
    assert a == model.predict_horizon(PROMPTS, seed=1, **kw)
    assert a != model.predict_horizon(PROMPTS, seed=2, **kw)
    # the value path does not depend on the paths, nor on u drawn per path or per step
    alone = model.predict_horizon(PROMPTS, tokenizer=qwen_tokenizer, horizon=3, paths=0, levels=None,
                                  continuations=CONTS)
    step = model.predict_horizon(PROMPTS, seed=1, individual="step", **kw)
    for x, y, z in zip(a, alone, step):
        assert list(y["horizon"][0]) == ["step", "value"]
        for h in range(3):
            assert x["horizon"][h]["value"] == pytest.approx(y["horizon"][h]["value"], rel=1e-5, abs=1e-4)
            assert z["horizon"][h]["value"] == pytest.approx(y["horizon"][h]["value"], rel=1e-5, abs=1e-4)


def test_individual_draw_is_the_heads_cauchy_at_the_quantile_u_gives():
    """w_reg . (u - loc_U) / (|w_reg| . scale_U') is a standard Cauchy: its quartiles are -1, 1 (`heads.individual_draw`,
    the value of the horizon's sampled paths and of causal `generate`)."""
    from causal_adapter.modeling.cauchy import cauchy_cdf
    from causal_adapter.modeling.heads import individual_draw

    class Act:
        w_reg = torch.tensor([2.0, -0.5, 0.0], dtype=torch.float64)

    g = torch.Generator().manual_seed(0)
    eps = torch.rand(40000, 3, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.3, 4.0, 1.0], dtype=torch.float64).expand(40000, 3)
    t = individual_draw(Act, eps, scale)
    q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    assert q.tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=0.04)
    # a head that does not read u: the exogenous noise, drawn from the individual's first coordinate (the lanes part)
    Act.w_reg = torch.zeros(3, dtype=torch.float64)
    t0 = individual_draw(Act, eps, scale)
    assert torch.allclose(t0, torch.tan(math.pi * (eps[:, 0] - 0.5)), rtol=1e-9, atol=1e-9)
    q0 = torch.quantile(t0, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    assert q0.tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=0.04)
    # the mixture quantile of one component is its own quantile
    loc, sc = torch.tensor([[3.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)
    assert float(hz.mixture_quantile(loc, sc, 0.75)) == pytest.approx(5.0, abs=1e-9)
    two = hz.mixture_quantile(torch.tensor([[0.0, 10.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), 0.5)
    assert float(((cauchy_cdf(two, 0.0, 1.0) + cauchy_cdf(two, 10.0, 1.0)) / 2)) == pytest.approx(0.5, abs=1e-9)


def test_free_text_paths_write_their_own_text(saved, qwen_tokenizer):
    """Without continuations the lanes write the text up to each value, a number written after the two tokens the
    prompt ends with: an adapter whose <NUM> always wins, with the number layout " " (a <NUM> after another token is
    written after a space), writes "v1 v2 v3"; an untrained one writes no value and says so."""
    _, model = saved
    with pytest.raises(ValueError, match="wrote no value .* give the row's continuations"):
        model.predict_horizon(PROMPTS[2:], tokenizer=qwen_tokenizer, horizon=2, paths=20)
    prompts = ["Counts: 3 4 5 ", "Yearly sunspot numbers 105.5 104.5 66.6 "]
    cfg = model.causal_config
    space = qwen_tokenizer.convert_tokens_to_ids("\u0120")
    with numbers_always_win(model):
        # no number layout: <NUM> right after <NUM>, never after the prompt's " ": numbers of the text, no value
        with pytest.raises(ValueError, match="wrote no value"):
            model.predict_horizon(prompts, tokenizer=qwen_tokenizer, horizon=2, paths=20)
        cfg.number_prefix_id, cfg.number_contexts = space, [space]
        out = model.predict_horizon(prompts, tokenizer=qwen_tokenizer, horizon=3, paths=20, seed=0)
        one = model.predict_values(prompts, tokenizer=qwen_tokenizer)
        for a, b in zip(one, out):
            assert b["horizon"][0]["value"] == a["value"] and len(b["horizon"]) == 3
            assert all(math.isfinite(s["value"]) and s["lower_90"] <= s["upper_90"] for s in b["horizon"])
        assert out == model.predict_horizon(prompts, tokenizer=qwen_tokenizer, horizon=3, paths=20, seed=0)
        fresh = model.predict_horizon(prompts, tokenizer=qwen_tokenizer, horizon=3, paths=20, seed=0, individual="step")
        assert [[s["value"] for s in r["horizon"]] for r in fresh] == [[s["value"] for s in r["horizon"]] for r in out]
        # the deterministic lane wrote " " and <NUM> after each value: value h + 1 is predict's after "v1 .. vh "
        for prompt, b in zip(prompts, out):
            text = prompt
            for h in (1, 2):
                text += format_number(round(b["horizon"][h - 1]["value"], 1)) + " "
                ref = model.predict_values([text], tokenizer=qwen_tokenizer)[0]["value"]
                assert b["horizon"][h]["value"] == pytest.approx(ref, rel=1e-4, abs=1e-3)


@contextlib.contextmanager
def numbers_always_win(model, layout: int | None = None):
    """<NUM> the argmax everywhere (b_cls 1e4), with the number layout `layout` (a <NUM> after another token is
    written after it) when given; the adapter restored after."""
    cfg, b_cls = model.causal_config, model.action.b_cls
    keep = b_cls.detach().clone(), cfg.number_prefix_id, cfg.number_contexts
    try:
        with torch.no_grad():
            b_cls[model.num_token_id] = 1e4
        if layout is not None:
            cfg.number_prefix_id, cfg.number_contexts = layout, [layout]
        yield
    finally:
        with torch.no_grad():
            b_cls.copy_(keep[0])
        cfg.number_prefix_id, cfg.number_contexts = keep[1], keep[2]


def test_bad_input_names_the_problem(saved, qwen_tokenizer):
    _, model = saved
    kw = dict(tokenizer=qwen_tokenizer)
    for extra, needle in ((dict(horizon=0), r"horizon must be an integer in \[1, 64\]"),
                          (dict(horizon=hz.MAX_HORIZON + 1), "horizon must be"),
                          (dict(horizon=3, paths=10, continuations=CONTS), "at least 20"),
                          (dict(horizon=3, continuations=[["; 1975: "], *CONTS[1:]]), "row 0: continuations holds 1"),
                          (dict(horizon=3, continuations=CONTS[:2]), "one list per prompt")):
        with pytest.raises(ValueError, match=needle):
            model.predict_horizon(PROMPTS, **{**kw, **extra})
    with pytest.raises(ValueError, match="row 0: the prompt holds no number and has no continuations"):
        model.predict_horizon(["Rain next month: "], horizon=2, **kw)


def test_completion_steps_reads_values_and_labels_from_a_forecasting_row():
    NUM, SP, SEMI, DASH, COLON, Q = 999, 5, 6, 7, 3, 8
    # "T 2016-07:" + " 33.2; 2016-08: 32.9; 2016-09: 30.4" as tokens (' ' before each number)
    prompt = [1, 2, SP, NUM, DASH, NUM, COLON]
    comp = [SP, NUM, SEMI, SP, NUM, DASH, NUM, COLON, SP, NUM, SEMI, SP, NUM, DASH, NUM, COLON, SP, NUM]
    ids = prompt + comp
    vals = [0, 0, 0, 2016, 0, 7, 0, 0, 33.2, 0, 0, 2016, 0, 8, 0, 0, 32.9, 0, 0, 2016, 0, 9, 0, 0, 30.4]
    labels = [-100] * len(prompt) + comp
    p_ids, p_vals, y, conts = hz_train().completion_steps(ids, vals, labels, NUM)
    assert p_ids == prompt + [SP] and y == [33.2, 32.9, 30.4] and p_vals[3] == 2016
    assert conts[0] == ([SEMI, SP, NUM, DASH, NUM, COLON, SP], [0.0, 0.0, 2016.0, 0.0, 8.0, 0.0, 0.0])
    assert len(conts) == 2
    # labels without numbers ("; Jan: 5.1; Feb: 6.2"): every number after ": " is a value
    words = [1, 11, COLON] + [SP, NUM, SEMI, SP, 12, COLON, SP, NUM, SEMI, SP, 13, COLON, SP, NUM]
    got = hz_train().completion_steps(words, [0, 0, 0, 0, 5.1] + [0] * 5 + [6.2] + [0] * 5 + [7.3],
                                      [-100] * 3 + words[3:], NUM)
    assert got[2] == [5.1, 6.2, 7.3] and got[3][0][0] == [SEMI, SP, 12, COLON, SP]
    # one value; records that change shape after value 2 keep the steps read before
    assert hz_train().completion_steps(prompt + [SP, NUM], vals[:9], [-100] * 7 + [SP, NUM], NUM) is None
    odd = comp[:10] + [SEMI, SP, NUM, COLON, SP, NUM]  # a label of one number where the others have two
    got = hz_train().completion_steps(prompt + odd, vals[:len(prompt + odd)] + [0] * 10, [-100] * 7 + odd, NUM)
    assert len(got[2]) == 2
    del Q


def hz_train():
    from causal_adapter.training.value_head import horizon

    return horizon


def test_predict_command_horizon_jsonl_csv_and_errors(tmp_path, saved, qwen_tokenizer, capsys):
    adapter, model = saved
    rows = [{"prompt": p, "continuations": c} for p, c in zip(PROMPTS, CONTS)]
    rows.insert(1, {"prompt": None, "continuations": None})
    data = _jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "pred.jsonl"
    base = ["predict", str(adapter), *TINY32, "--data-file", str(data)]
    assert main(base + ["--output", str(out), "--horizon", "3", "--paths", "20"]) == 0
    err = capsys.readouterr().err
    assert "no per-step calibration" in err and "3 of 4 rows written" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in got] == [0, 2, 3]
    api = model.predict_horizon(PROMPTS, tokenizer=qwen_tokenizer, horizon=3, paths=20, continuations=CONTS)
    one = model.predict_values(PROMPTS, tokenizer=qwen_tokenizer)
    for g, a, o in zip(got, api, one):
        assert g["horizon"] == a["horizon"]
        assert g["value"] == o["value"] and g["horizon"][0]["value"] == o["value"]  # step 1 is predict's
    csv_out = tmp_path / "pred.csv"
    assert main(base + ["--output", str(csv_out), "--horizon", "3", "--paths", "20", "--levels", "0.8"]) == 0
    with open(csv_out, newline="") as fh:
        flat = list(csv.DictReader(fh))
    assert "h3_upper_80" in flat[0] and "h1_value" in flat[0] and "horizon" not in flat[0]
    capsys.readouterr()
    # bad input: one or two lines, nothing written
    out.write_text("previous\n")
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"prompt": PROMPTS[0], "continuations": ["; 1975: "]}])
    nonum = _jsonl(tmp_path / "nonum.jsonl", [{"prompt": "Rain next month: "}])
    for args, needle in ((base + ["--horizon", "0"], "horizon must be an integer in [1, 64]"),
                         (base + ["--horizon", "65"], "horizon must be an integer in [1, 64]"),
                         (base + ["--horizon", "3", "--paths", "19"], "at least 20"),
                         (["predict", str(adapter), *TINY32, "--data-file", str(wrong), "--horizon", "3"],
                          "row 0: continuations holds 1 texts; horizon 3 needs 2"),
                         (["predict", str(adapter), *TINY32, "--data-file", str(nonum), "--horizon", "2"],
                          "row 0: the prompt holds no number and has no continuations")):
        assert main(args + ["--output", str(out)]) == 1
        err = capsys.readouterr().err
        lines = [x for x in err.strip().splitlines() if "examples" not in x]  # datasets' loading bar aside
        assert needle in err and len(lines) <= 2, err
        assert out.read_text() == "previous\n"


def _forecast_rows(series, start, stop, H, window=8):
    """Rows of a forecasting file: the window's "t: v" pairs, the completion the next H values with their labels."""
    rows = []
    for k, (title, values) in enumerate(series):
        text = [format_number(v) for v in values]
        for i in range(max(start, window), min(stop, len(values) - H + 1)):
            hist = "; ".join(f"{2000 + j}: {text[j]}" for j in range(i - window, i))
            comp = " " + text[i] + "".join(f"; {2000 + j}: {text[j]}" for j in range(i + 1, i + H))
            rows.append({"prompt": f"{title} {hist}; {2000 + i}:", "completion": comp})
    return rows


def test_train_fits_per_step_maps_on_forecasting_validation_rows(tmp_path, qwen_tokenizer, capsys):
    """`train --train-file --validation-file`, no other flag: the per-step maps of the validation rows' steps 2..4
    are fitted, saved with the adapter, reloaded, and used by predict --horizon (beyond them: widened)."""
    g = torch.Generator().manual_seed(0)
    series = []
    for k in range(3):
        level = 50.0 * (k + 1)
        walk = (torch.randn(60, generator=g, dtype=torch.float64) * 0.05 * level).cumsum(0) + level
        series.append((f"Series {k}.", [round(float(v), 1) for v in walk]))
    train_rows, val_rows = _forecast_rows(series, 0, 44, 4), _forecast_rows(series, 44, 60, 4)
    assert len(val_rows) >= 12
    tr, va = _jsonl(tmp_path / "train.jsonl", train_rows), _jsonl(tmp_path / "val.jsonl", val_rows)
    run = tmp_path / "run"
    assert main(["train", "--train-file", str(tr), "--validation-file", str(va), "--output-dir", str(run),
                 "--max-steps", "2", "--tiny-hidden-size", "16", "--tiny-layers", "1", "--no-plot"]) == 0
    log = capsys.readouterr().err
    heads = [line for line in log.splitlines() if line.startswith("value head:")]
    assert heads and all(f"rows={4 * len(train_rows)}," in h for h in heads), heads  # the fit's targets: the values
    cfg = json.loads((run / "adapter" / "causal_adapter_config.json").read_text())
    cal = cfg["adapter_config"]["horizon_calibration"]
    assert cal["individual"] in hz.INDIVIDUALS and len(cal["steps"]) == 3  # steps 2, 3, 4
    assert all(m["n"] == len(val_rows) for m in cal["steps"])
    # the head's units and its one-step map read the values, not the labels' years (records.value_label_mask)
    assert cfg["adapter_config"]["value_calibration"]["n"] == 4 * len(val_rows)
    values = [float(v) for r in train_rows for v in r["completion"].replace(";", ":").split(":")[::2]]
    assert len(values) == 4 * len(train_rows) and max(values) < 1000
    assert cfg["adapter_config"]["value_loc"] == pytest.approx(fit_value_units(values)[0])
    if cfg["adapter_config"]["value_transform"] == "log":
        assert cfg["adapter_config"]["value_log_units"][0] == pytest.approx(fit_value_units(map(math.log, values))[0])
    pred = _jsonl(tmp_path / "pred_in.jsonl", [{"prompt": r["prompt"], "completion": r["completion"][:6],
                                                "continuations": ["; 2070:", "; 2071:", "; 2072:", "; 2073:"]}
                                               for r in val_rows[:2]])
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(run / "adapter"), "--tiny-hidden-size", "16", "--tiny-layers", "1", "--data-file",
                 str(pred), "--output", str(out), "--horizon", "5", "--paths", "20"]) == 0
    err = capsys.readouterr().err
    assert "validation covered steps 1..4" in err and "widened" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["horizon"]) for r in got] == [5, 5]
    for r in got:
        w = [s["upper_90"] - s["lower_90"] for s in r["horizon"]]
        assert all(math.isfinite(x) and x > 0 for x in w)


def test_server_predict_takes_horizon_and_paths(saved, qwen_tokenizer, tmp_path):
    """`/v1/predict` with horizon / paths / continuations / seed: the rows `predict_horizon` gives in-process; bad
    values get a 400 naming the field, and so do more paths than the server's --max-paths."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serve_fixtures import Server

    adapter, model = saved
    server = Server(["--adapter", f"h={adapter}", *TINY32, "--max-paths", "100"], tmp_path / "serve.log")
    try:
        url = server.wait_ready().url

        def post(body):
            return httpx.post(url + "/v1/predict", json={"model": "h", "prompts": PROMPTS, **body}, timeout=120)

        r = post({"horizon": 3, "paths": 20, "continuations": CONTS, "seed": 3})
        assert r.status_code == 200, r.text
        got = r.json()["data"]
        want = model.predict_horizon(PROMPTS, tokenizer=qwen_tokenizer, horizon=3, paths=20, continuations=CONTS,
                                     seed=3)
        # each step says whether its intervals are calibrated (`hz.step_intervals`): this adapter has a one-step
        # map and no per-step maps, so step 1 is and steps 2, 3 (the paths' raw intervals) are not
        assert model.causal_config.value_calibration is not None and model.causal_config.horizon_calibration is None
        for g, w in zip(got, want):
            assert [(s.pop("calibrated"), s.pop("intervals")) for s in g["horizon"]] == \
                [(True, "calibrated"), (False, "raw"), (False, "raw")]
            assert g["horizon"] == w["horizon"] and g["value"] == w["value"]
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["value_decimals"]) for m in models] == [("h", model.causal_config.value_decimals)] == \
            [("h", 1)]
        assert "horizon" not in post({}).json()["data"][0]  # without it: predict's rows as before
        for body, field in (({"horizon": 0}, "horizon"), ({"horizon": 3, "paths": 5}, "paths"),
                            ({"paths": 30}, "paths"), ({"horizon": 3, "continuations": CONTS[:1]}, "continuations"),
                            ({"horizon": 3, "paths": 101}, "serve --max-paths")):  # the server's own bound
            r = post(body)
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"], r.json()
    finally:
        server.stop()


def _lanes(model, tokenizer, prompt, horizon, paths, conts, individual, seed=0):
    """The lanes of one prompt exactly as `predict_horizon` runs them (the same prompt ids, generator and rows of the
    step loop, `horizon.run_lanes`): the `Paths` of its 1 + `paths` lanes (lane 0 deterministic, lanes 1.. sampled)."""
    from causal_adapter.modeling.generation.prepare import text_prompts_tokenizer
    from causal_adapter.modeling.prediction import encoded_batches

    ntok = text_prompts_tokenizer(model, [prompt], tokenizer, "test")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    model.eval()
    ((_, enc),) = encoded_batches(model, ntok, [prompt], 1)
    ids, vals = enc["input_ids"][0].tolist(), enc["numeric_values"][0].tolist()
    cont = None if conts is None else hz.continuation_tokens(model, ntok, conts)
    return hz.run_lanes(model, ntok, ids, vals, cont, horizon, paths, gen, individual)


def _assert_lanes_part(p, paths, horizon):
    """Every sampled lane has its own value at every step (its own u: a lane copying another's noise would repeat its
    values), and its own head at every step after the first (each lane fed back its own values)."""
    assert p.value.shape == (1 + paths, horizon)
    for h in range(horizon):
        sampled = p.value[1:, h]
        assert bool(torch.isfinite(sampled).all()), (h, sampled)
        distinct = len(set(sampled.tolist()))
        assert distinct == paths, f"step {h + 1}: {distinct} distinct values over {paths} lanes"
        if h:
            assert len(set(p.loc_Y[1:, h].tolist())) == paths, f"step {h + 1}: lanes share their head's location"


@pytest.mark.parametrize("individual", hz.INDIVIDUALS)
def test_sampled_lanes_draw_their_own_noise(saved, qwen_tokenizer, individual):
    """Each sampled lane draws its own eps (u): its values differ from every other lane's at every step, with the
    continuations forced and with the text written by the lanes themselves, u drawn once per path or at every step.
    (The intervals are the mixture over the lanes: lanes sharing one draw collapse it to one lane's Cauchy.)"""
    _, model = saved
    paths = 20
    p = _lanes(model, qwen_tokenizer, PROMPTS[0], 3, paths, CONTS[0], individual)
    _assert_lanes_part(p, paths, 3)
    # lane 0 is the deterministic path: the head's location itself at every step
    assert torch.equal(p.value[0], p.loc_Y[0])
    # free text: an adapter whose <NUM> always wins, with the layout " " (as test_free_text_paths_write_their_own_text)
    with numbers_always_win(model, layout=qwen_tokenizer.convert_tokens_to_ids("\u0120")):
        p = _lanes(model, qwen_tokenizer, "Counts: 3 4 5 ", 3, paths, None, individual)
        _assert_lanes_part(p, paths, 3)


def _step_map(c50: float, c90: float) -> dict:
    """A per-step map (as `value_calibration`) whose 50% multiplier is c50 and 90% multiplier c90: n = 9 scores, the
    50% one the ceil(10 * 0.5) = 5th smallest, the 90% one the ceil(10 * 0.9) = 9th."""
    return {"n": 9, "scores": [float(c50)] * 5 + [float(c90)] * 4}


#: per-step multipliers (c_50, c_90) of steps 2, 3, 4: each step its own, none the one-step map's (~1.35, ~3.3)
STEP_MULTIPLIERS = [(0.5, 2.0), (1.7, 4.5), (2.6, 8.0)]


def test_step_intervals_says_which_steps_are_calibrated(saved):
    """`step_intervals`: step 1 "calibrated" with a one-step map (else "raw"); step h >= 2 "calibrated" where
    horizon_calibration has its own map, "widened" beyond the last one (as `widened_multiplier` says: not calibrated),
    "raw" without per-step maps. `predict`'s stderr note follows it (`commands.predict.horizon_notes`)."""
    from types import SimpleNamespace

    from causal_adapter.commands.predict import horizon_notes

    _, model = saved
    one, steps = model.causal_config.value_calibration, [_step_map(*c) for c in STEP_MULTIPLIERS]  # steps 2..4
    cal = {"individual": "path", "paths": 20, "steps": steps}
    for value_cal, horizon_cal, H, want in (
            (one, None, 4, ["calibrated", "raw", "raw", "raw"]),
            (None, None, 2, ["raw", "raw"]),
            (one, cal, 1, ["calibrated"]),
            (one, cal, 4, ["calibrated"] * 4),
            (one, cal, 6, ["calibrated"] * 4 + ["widened"] * 2),
            (None, cal, 5, ["raw", "calibrated", "calibrated", "calibrated", "widened"])):
        config = SimpleNamespace(value_calibration=value_cal, horizon_calibration=horizon_cal)
        assert hz.step_intervals(config, H) == want, (value_cal is not None, horizon_cal is not None, H)
        for h, kind in enumerate(want[1:], 2):  # the rule horizon_steps' multipliers follow
            if horizon_cal:
                assert hz.widened_multiplier(steps, h, 0.9)[1] == (kind == "calibrated")
        model_like = SimpleNamespace(causal_config=config)
        notes = horizon_notes(model_like, H)
        if "raw" in want[1:]:
            assert len(notes) == 1 and "no per-step calibration" in notes[0]
        elif "widened" in want:
            assert notes == [f"predict: validation covered steps 1..4; the intervals of steps 5..{H} are step 4's "
                             f"widened by sqrt(step / 4) (docs/predict.md, \"A horizon\")"]
        else:
            assert notes == []


def _horizon_with(model, tokenizer, calibration, horizon):
    """predict_horizon of PROMPTS under `calibration` (set on the adapter for the call), u drawn per path, seed 0."""
    from causal_adapter.config import _validate_horizon_calibration

    _validate_horizon_calibration(calibration)  # a map the adapter could hold
    cfg = model.causal_config
    keep = cfg.horizon_calibration
    cfg.horizon_calibration = calibration
    try:
        return model.predict_horizon(PROMPTS, tokenizer=tokenizer, horizon=horizon, paths=20, seed=0,
                                     continuations=[c + ["; 1990: "] * (horizon - 3) for c in CONTS])
    finally:
        cfg.horizon_calibration = keep


def test_each_step_uses_its_own_map_and_steps_beyond_are_widened_by_sqrt(saved, qwen_tokenizer):
    """With a per-step calibration (maps of steps 2..4, H_v = 4), step h's interval at level q is value_h -+ c_{h,q}
    s_h on the head's scale: c_{h,q} the multiplier of step h's OWN map (not step 2's, not the one-step map
    `value_calibration`), and beyond H_v the last map's multiplier times sqrt(h / H_v) exactly. Step 1 stays the
    one-step prediction (value_calibration's intervals). s_h, the paths' spread, is read from the same paths under
    maps of multiplier 1 at every step."""
    from causal_adapter.modeling.intervals import conformal_multiplier

    _, model = saved
    H, vm = 6, model.value_map
    one_step = model.causal_config.value_calibration
    steps = [_step_map(*c) for c in STEP_MULTIPLIERS]
    for m, (c50, c90) in zip(steps, STEP_MULTIPLIERS):  # the maps say what the test means them to
        assert conformal_multiplier(m, 0.5) == c50 and conformal_multiplier(m, 0.9) == c90
        for q in (0.5, 0.9):
            assert abs(conformal_multiplier(m, q) - conformal_multiplier(one_step, q)) > 0.2
    unit = _horizon_with(model, qwen_tokenizer, {"individual": "path", "paths": 20,
                                                 "steps": [_step_map(1.0, 1.0)] * (H - 1)}, H)
    got = _horizon_with(model, qwen_tokenizer, {"individual": "path", "paths": 20, "steps": steps}, H)
    one = model.predict_values(PROMPTS, tokenizer=qwen_tokenizer)

    def head(x):
        return float(vm.to_head(torch.tensor(x, dtype=torch.float64)))

    for r, u, o in zip(got, unit, one):
        assert r["horizon"][0] == {"step": 1, "value": o["value"], **{f"{s}_{n}": o[f"{s}_{n}"] for n in (50, 90)
                                                                      for s in ("lower", "upper")}}
        for h in range(2, H + 1):
            s, su = r["horizon"][h - 1], u["horizon"][h - 1]
            assert s["value"] == su["value"]  # the same paths: only the multipliers differ
            for q, n, k in ((0.5, 50, 0), (0.9, 90, 1)):
                spread = (head(su[f"upper_{n}"]) - head(su[f"lower_{n}"])) / 2  # c = 1: the half-width is s_h
                assert spread > 0
                if h <= 4:
                    c = STEP_MULTIPLIERS[h - 2][k]
                else:  # beyond the last calibrated step H_v = 4: its multiplier widened by sqrt(h / H_v)
                    c = STEP_MULTIPLIERS[-1][k] * math.sqrt(h / 4)
                lo, hi = head(s[f"lower_{n}"]), head(s[f"upper_{n}"])
                assert (hi - lo) / 2 == pytest.approx(c * spread, rel=1e-9), (h, n, c, (hi - lo) / 2 / spread)
                assert (hi + lo) / 2 == pytest.approx(head(s["value"]), rel=1e-9, abs=1e-9)  # around the path's value


def _mixture_cdf(loc, scale, x):
    """The equal mixture of Cauchy(loc_i, scale_i) [N] at x (torch.distributions: independent of `mixture_quantile`)."""
    return float(torch.distributions.Cauchy(loc, scale).cdf(torch.tensor(x, dtype=torch.float64)).mean())


def test_raw_intervals_are_the_sampled_lanes_mixture_and_the_spread_its_quartiles(saved, qwen_tokenizer):
    """Without a per-step map, step h's interval at level q is the central q interval of the equal mixture of the
    SAMPLED lanes' Cauchy(loc_Y, scale_Y) at step h (lane 0 left out), its value the deterministic lane's; with maps,
    the spread s_h the maps multiply is that mixture's 50% half-width (checked with maps of multiplier 1), centred on
    the deterministic lane's location. The lanes are `run_lanes`' for the same prompt, seed and paths."""
    _, model = saved
    vm, H, paths = model.value_map, 4, 20
    conts = CONTS[0] + ["; 1977: "]
    p = _lanes(model, qwen_tokenizer, PROMPTS[0], H, paths, conts, "path", seed=0)
    assert model.causal_config.horizon_calibration is None
    raw = model.predict_horizon(PROMPTS[0], tokenizer=qwen_tokenizer, horizon=H, paths=paths, seed=0,
                                continuations=conts)[0]["horizon"]
    cfg = model.causal_config
    cfg.horizon_calibration = {"individual": "path", "paths": paths, "steps": [_step_map(1.0, 1.0)] * (H - 1)}
    try:
        unit = model.predict_horizon(PROMPTS[0], tokenizer=qwen_tokenizer, horizon=H, paths=paths, seed=0,
                                     continuations=conts)[0]["horizon"]
    finally:
        cfg.horizon_calibration = None

    def head(x):
        return float(vm.to_head(torch.tensor(x, dtype=torch.float64)))

    for h in range(2, H + 1):
        loc, scale = p.loc_Y[1:, h - 1], p.scale_Y[1:, h - 1]
        assert raw[h - 1]["value"] == pytest.approx(float(p.value[0, h - 1]), rel=1e-6)
        for q, n in ((0.5, 50), (0.9, 90)):
            lo, hi = head(raw[h - 1][f"lower_{n}"]), head(raw[h - 1][f"upper_{n}"])
            assert _mixture_cdf(loc, scale, lo) == pytest.approx((1 - q) / 2, abs=1e-6), (h, n)
            assert _mixture_cdf(loc, scale, hi) == pytest.approx((1 + q) / 2, abs=1e-6), (h, n)
        q25, q75 = head(raw[h - 1]["lower_50"]), head(raw[h - 1]["upper_50"])
        for n in (50, 90):  # multiplier 1: centre -+ s_h, s_h the mixture's 50% half-width
            lo, hi = head(unit[h - 1][f"lower_{n}"]), head(unit[h - 1][f"upper_{n}"])
            assert (hi - lo) / 2 == pytest.approx((q75 - q25) / 2, rel=1e-6), (h, n)
            assert (hi + lo) / 2 == pytest.approx(float(p.loc_Y[0, h - 1]), rel=1e-6, abs=1e-9)


def test_fit_horizon_calibration_keeps_the_better_way_and_each_steps_own_scores(saved, qwen_tokenizer):
    """`fit_horizon_calibration` on tokenized validation rows of a forecasting file (3 values each): the way of
    drawing u it keeps is the one with the smaller held-out score it reports ("path" on a tie), and the map of step
    h (h = 2, 3) holds that way's scores |y_h - v_h| / s_h of step h: v_h the deterministic lane's location at step h,
    s_h the mixture's 50% half-width, from `run_lanes` of the rows (the residuals here are far above the written
    resolution: no floor applies)."""
    from datasets import Dataset

    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.modeling.intervals import fit_calibration
    from causal_adapter.numbers import NumberTokenizer

    fit = hz_train()
    _, model = saved
    g = torch.Generator().manual_seed(1)
    series = []
    for k in range(2):
        walk = (torch.randn(24, generator=g, dtype=torch.float64) * 3.0).cumsum(0) + 60.0 * (k + 1)
        series.append((f"Series {k}.", [round(float(v), 1) for v in walk]))
    rows = _forecast_rows(series, 0, 24, 3, window=4)[:14]
    ds = tokenize_dataset(Dataset.from_list(rows), NumberTokenizer(qwen_tokenizer, model.num_token_id))
    cfg = model.causal_config
    try:
        summary = fit.fit_horizon_calibration(model, ds, paths=20)
        cal = cfg.horizon_calibration
    finally:
        cfg.horizon_calibration = None
    assert summary is not None and summary.rows == len(rows) and summary.steps == 3
    scores = summary.scores
    assert set(scores) == set(hz.INDIVIDUALS)
    best = min(scores.values())
    assert summary.individual == cal["individual"] == next(k for k in hz.INDIVIDUALS if scores[k] == best)
    assert all(len(summary.raw_coverage[summary.individual][level]) == 2 for level in (50, 90))
    # the flat log line, as before the summary was typed
    flat = summary.as_dict()
    assert flat["horizon_rows"] == len(rows) and flat["horizon_individual"] == summary.individual
    assert dict(summary.items()) == flat and summary["horizon_steps"] == 3
    assert {f"horizon_score_{k}" for k in hz.INDIVIDUALS} | {f"horizon_raw_cov{q}_{k}" for q in (50, 90)
                                                              for k in hz.INDIVIDUALS} <= set(flat)
    assert cal["paths"] == 20 and len(cal["steps"]) == 2
    # the chosen way's paths, run again as the fit runs them (the same seed), and each step's scores
    steps = fit.horizon_rows(ds, model.num_token_id)
    assert len(steps) == len(rows)
    results = fit.run_rows(model, steps, cal["individual"], 20)
    for h in (2, 3):
        y = model.value_map.to_head(torch.tensor([ys[h - 1] for _, ys, _ in results], dtype=torch.float64))
        centre = torch.stack([p.loc_Y[0, h - 1] for p, _, _ in results])
        spread = torch.tensor([float(hz.path_spread(p)[1][h - 1]) for p, _, _ in results], dtype=torch.float64)
        assert bool(((y - centre).abs() > 1.0).all())  # far above the resolution: no floor
        assert cal["steps"][h - 2] == fit_calibration(y, centre, spread), h
