"""The playground page of `causal-adapter serve` (GET /) in a real browser: Debian's chromium and chromium-driver
driven by Selenium, against a live server (with --api-key) on two toy adapters. The page's numbers, intervals and
plot are compared with what the API returns for the same requests (deterministic decoding: the same text and
values). Without selenium, chromium or chromedriver the browser tests skip (the reason names what is missing); under
CI=true they fail instead, so a CI whose browser install broke cannot pass with them skipped (.ci/run installs them).

CAUSAL_ADAPTER_PLAYGROUND_SHOTS=docs/images: also writes the two screenshots docs/serving.md shows there."""
import json
import math
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'causal_adapter[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra: pip install 'causal_adapter[serve]'")
httpx = pytest.importorskip("httpx")

from serve_fixtures import Server, make_adapter  # noqa: E402

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # the tests that need no browser still run
    webdriver = None

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")


def missing_browser() -> str | None:
    """What the browser tests lack (selenium, chromium, chromedriver), in words; None when nothing is missing."""
    missing = [what for what, found in (("selenium (pip install selenium; the dev extra has it)", webdriver),
                                        ("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if found is None]
    if not missing:
        return None
    return ("no browser to drive: missing " + ", ".join(missing) + " (PATH searched: chromium / chromium-browser / "
            "google-chrome and chromedriver; Debian: apt-get install chromium chromium-driver; .ci/run installs them)")


MISSING_BROWSER = missing_browser()
# CI (.ci/run) installs the browser: there a missing one is a broken install, and the browser tests fail (in the
# `browser` fixture) rather than skip; a skip would let CI pass without the page ever being driven.
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
needs_browser = pytest.mark.skipif(MISSING_BROWSER is not None and not IN_CI, reason=str(MISSING_BROWSER))

KEY = "playground-key"
#: the toy adapters' value_decimals (serve_fixtures.make_adapter: their data written with one decimal)
DECIMALS = 1
PROMPT = "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971:"
MAX_TOKENS = 8
SHOTS = os.environ.get("CAUSAL_ADAPTER_PLAYGROUND_SHOTS")


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen_tokenizer):
    """a (finite intervals) and b (too few calibration rows: an unbounded 90% interval) behind --api-key."""
    d = tmp_path_factory.mktemp("playground")
    a = make_adapter(d / "a", qwen_tokenizer, seed=2, value_loc=39.0, value_scale=38.0)
    b = make_adapter(d / "b", qwen_tokenizer, seed=6, value_loc=500.0, value_scale=100.0, calibration_rows=8)
    s = Server(["--adapter", f"a={a}", "--adapter", f"b={b}", "--api-key", KEY], d / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    """Headless chromium driven by chromedriver; under CI=true a missing browser fails the tests that need it."""
    if MISSING_BROWSER is not None:  # only reached under CI: needs_browser skips these tests elsewhere
        pytest.fail(f"CI=true and {MISSING_BROWSER}", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,900",
                "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--disable-default-apps", "--hide-scrollbars"):
        opts.add_argument(arg)
    # the performance log: every request the page's tab makes (Network.requestWillBeSent)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def api(server, path, body):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def wait(driver, predicate, what, timeout=60):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d))
    except TimeoutException:
        err = driver.find_element(By.ID, "error").text
        raise AssertionError(f"timed out waiting for {what} (the page's error box: {err!r})") from None


def open_page(d, server, adapter="a"):
    """The page loaded afresh, the key typed into the form it shows, `adapter` picked."""
    d.get(server.url + "/")
    wait(d, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the key form")
    d.find_element(By.ID, "api-key").send_keys(KEY + Keys.ENTER)
    wait(d, lambda d: len(Select(d.find_element(By.ID, "adapter")).options) == 2, "the adapters")
    Select(d.find_element(By.ID, "adapter")).select_by_value(adapter)


INFINITIES = {"\u221e": math.inf, "\u2212\u221e": -math.inf}


def shown(text):
    """A number as the page shows it ("1.5", "\u221e", "\u2212\u221e")."""
    return INFINITIES[text] if text in INFINITIES else float(text)


def shown_interval(text):
    m = re.fullmatch(r"\[(.+), (.+)\]", text)
    assert m, f"not an interval: {text!r}"
    return shown(m.group(1)), shown(m.group(2))


def close(page, api_value):
    """A probability (P(<NUM>)): the page shows 6 significant digits."""
    if math.isinf(api_value):
        return page == api_value
    return page == pytest.approx(api_value, rel=5e-6, abs=1e-9)


def close_value(page, api_value):
    """A value or a bound: the page shows the adapter's `DECIMALS`."""
    if math.isinf(api_value):
        return page == api_value
    return page == pytest.approx(api_value, abs=0.5 * 10 ** -DECIMALS + 1e-9)


def screenshot(driver, path: Path, docs_name: str | None = None):
    """The page at its full height (the window grown to it), into `path`; with SHOTS also into the docs."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.execute_script("return window.outerWidth")
    driver.set_window_size(width, min(height + 100, 2400))
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 1000
    if SHOTS and docs_name:
        shutil.copy(path, Path(SHOTS) / docs_name)


def test_page_is_open_relative_and_holds_no_key(server):
    r = httpx.get(server.url + "/", timeout=30)  # no key: the page holds nothing secret
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert KEY not in page and "Apache License, Version 2.0" in page
    assert not re.search(r"""["'`]/v1""", page), "an absolute /v1 URL: the page must work behind a path prefix"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads something from elsewhere"
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # the API itself still needs it


#: The page's whole Content-Security-Policy: its own origin only (routes_playground.PAGE_HEADERS says why).
CSP = {
    "default-src": {"'none'"},
    "script-src": {"'unsafe-inline'"},
    "style-src": {"'unsafe-inline'"},
    "img-src": {"'self'", "data:"},
    "connect-src": {"'self'"},
    "base-uri": {"'none'"},
    "form-action": {"'none'"},
    "frame-ancestors": {"'none'"},
}
#: The schemes a source may name: the ones the policy uses (data: for the inline favicon). Never http: / https:.
CSP_SCHEMES = {"data:"}


def csp_directives(policy: str) -> dict[str, set[str]]:
    """A Content-Security-Policy header as {directive: its sources} (directives split on ';', then whitespace)."""
    directives = {}
    for part in policy.split(";"):
        words = part.split()
        if not words:  # the empty part after a trailing ';'
            continue
        name, *sources = words
        assert name.lower() not in directives, f"{name} twice in {policy!r}: browsers keep the first, silently"
        directives[name.lower()] = set(sources)
    return directives


def test_page_csp_is_the_whole_policy_with_no_wildcard_or_host(server):
    """GET /'s Content-Security-Policy, directive by directive: exactly CSP, and no source anywhere that opens the
    page to another host (*, http:, https:, a host name): each is a quoted keyword or a scheme of CSP_SCHEMES."""
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200
    headers = r.headers.get_list("content-security-policy")
    assert len(headers) == 1, headers  # two policies would both apply: one is the policy
    directives = csp_directives(headers[0])
    for name, sources in directives.items():
        for source in sources:
            # a keyword is quoted ('self', 'none', 'unsafe-inline'); anything else bare is a host, a wildcard or a
            # scheme, and only the schemes the page needs pass
            assert re.fullmatch(r"'[a-z-]+'", source) or source in CSP_SCHEMES, \
                f"{name} {source}: not a quoted keyword nor one of {sorted(CSP_SCHEMES)} (a wildcard or a host)"
    assert directives == CSP


def test_no_ui_turns_the_page_off():
    """--no-ui: GET / is a 404 (the app without a model behind it: the page route needs none)."""
    from fastapi.testclient import TestClient

    from causal_adapter.commands.main import build_parser
    from causal_adapter.serving.app import create_app
    from causal_adapter.serving.registry import Registry

    def stub():
        return SimpleNamespace(registry=Registry(None, None), set_scheduler=lambda policy: None,
                               waiting_requests=lambda: 0, running=lambda: 0, loop=None, prefix=None)

    on, off = (TestClient(create_app(stub(), ui=ui, worker_thread=False)) for ui in (True, False))
    assert on.get("/").status_code == 200 and "<!doctype html>" in on.get("/").text
    r = off.get("/")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    args = build_parser().parse_args(["serve", "--adapter", "a=x", "--no-ui"])
    assert args.no_ui and not build_parser().parse_args(["serve", "--adapter", "a=x"]).no_ui


@needs_browser
def test_complete_shows_the_values_and_intervals_of_the_api(server, browser, tmp_path):
    d = browser
    d.get(server.url + "/")
    # the server has a key: the page asks for it (the 401 shown as a message, not a blank page)
    wait(d, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the key form")
    assert "API key" in d.find_element(By.ID, "error").text
    d.find_element(By.ID, "api-key").send_keys(KEY + Keys.ENTER)
    wait(d, lambda d: len(Select(d.find_element(By.ID, "adapter")).options) == 2, "the adapters")
    assert not d.find_element(By.ID, "error").is_displayed()
    assert KEY not in d.page_source.replace(f'value="{KEY}"', "")  # typed in, never written into the page
    assert [o.text for o in Select(d.find_element(By.ID, "adapter")).options] == ["a", "b"]

    # b: its calibrated 90% interval is unbounded (Infinity in the server's JSON)
    for adapter in ("b", "a"):
        Select(d.find_element(By.ID, "adapter")).select_by_value(adapter)
        prompt = d.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(PROMPT)
        Select(d.find_element(By.ID, "mode")).select_by_value("deterministic")
        tokens = d.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys(str(MAX_TOKENS))
        assert d.find_element(By.ID, "stream").is_selected()  # streamed
        d.find_element(By.ID, "run").click()
        wait(d, lambda d: "written" in d.find_element(By.ID, "complete-status").text, "the completion")

        # the server writes an unbounded interval as Infinity: Python's json (httpx's .json()) reads it
        want = api(server, "/v1/completions", {"model": adapter, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                               "mode": "deterministic"}).json()["choices"][0]
        assert d.find_element(By.ID, "output").text == want["text"]
        numbers = d.find_elements(By.CSS_SELECTOR, "#output button.num")
        assert want["values"] and [n.text for n in numbers] == [v["text"] for v in want["values"]]
        for k, (button, v) in enumerate(list(zip(numbers, want["values"]))[:4]):
            if k % 2 == 0:  # hover, or keyboard focus
                ActionChains(d).move_to_element(button).perform()
            else:
                d.execute_script("arguments[0].focus()", button)
            tip = wait(d, lambda d: d.find_element(By.ID, "tip") if d.find_element(By.ID, "tip").is_displayed()
                       else None, "the tooltip")
            field = {e.get_attribute("data-field"): e.text for e in tip.find_elements(By.TAG_NAME, "dd")}
            assert close_value(shown(field["value"]), v["value"])
            for level in (50, 90):
                lo, hi = shown_interval(field[f"interval-{level}"])
                assert close_value(lo, v[f"lower_{level}"]) and close_value(hi, v[f"upper_{level}"]), (level, field, v)
            assert close(shown(field["p-num"]), v["p_num"]) and 0 < v["p_num"] <= 1
            label = button.get_attribute("aria-label")
            assert field["interval-50"] in label and field["interval-90"] in label
        if adapter == "b":
            assert math.isinf(want["values"][0]["upper_90"]) and field["interval-90"].endswith("\u221e]")
        # the table of the numbers says the same
        first, v = d.find_element(By.CSS_SELECTOR, "#values-table tbody tr").find_elements(By.TAG_NAME, "td"), \
            want["values"][0]
        for col, level in ((1, 50), (2, 90)):
            lo, hi = shown_interval(first[col].text)
            assert close_value(lo, v[f"lower_{level}"]) and close_value(hi, v[f"upper_{level}"])

    ActionChains(d).move_to_element(numbers[0]).perform()  # the screenshot shows a number's tooltip
    screenshot(d, tmp_path / "complete.png", "playground-complete.png")


@needs_browser
def test_chat_keeps_the_conversation(server, browser):
    """Chat: each reply (not streamed here) is the API's for the conversation so far."""
    d = browser
    open_page(d, server)
    d.find_element(By.CSS_SELECTOR, "input[name=kind][value=chat]").click()
    d.find_element(By.ID, "stream").click()
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))
    messages = []
    for turn in ("Sunspots in 1969: 105.5. And in 1970?", "And in 1971?"):
        box = d.find_element(By.ID, "message")
        box.clear()
        box.send_keys(turn)
        d.find_element(By.ID, "run").click()
        wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat-log li")) == len(messages) + 2
             and "written" in d.find_element(By.ID, "complete-status").text, "the reply")
        messages.append({"role": "user", "content": turn})
        want = api(server, "/v1/chat/completions", {"model": "a", "messages": messages, "mode": "deterministic",
                                                    "max_tokens": MAX_TOKENS}).json()["choices"][0]
        reply = d.find_elements(By.CSS_SELECTOR, "#chat-log li .output")[-1]
        assert reply.text == want["message"]["content"]
        numbers = reply.find_elements(By.CSS_SELECTOR, "button.num")
        assert [b.text for b in numbers] == [v["text"] for v in want["values"]]
        messages.append({"role": "assistant", "content": want["message"]["content"]})
    d.find_element(By.ID, "chat-clear").click()
    assert not d.find_elements(By.CSS_SELECTOR, "#chat-log li")


@needs_browser
def test_predict_plots_the_bands_of_the_api(server, browser, tmp_path):
    d = browser
    open_page(d, server)
    tab = d.find_element(By.ID, "tab-complete")
    tab.send_keys(Keys.ARROW_RIGHT)  # the keyboard moves between the views
    assert d.switch_to.active_element == d.find_element(By.ID, "tab-predict")
    assert d.find_element(By.ID, "view-predict").is_displayed()
    prompt = json.loads(d.find_element(By.ID, "series-prompt").text)
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]"), "the plot")

    row = api(server, "/v1/predict", {"model": "a", "prompts": [prompt]}).json()["data"][0]
    svg = d.find_element(By.CSS_SELECTOR, "#plot svg")
    bands = {b: svg.find_element(By.CSS_SELECTOR, f"[data-band='{b}']") for b in ("90", "50", "point", "context")}
    assert float(bands["point"].get_attribute("data-value")) == pytest.approx(row["value"], rel=1e-9)
    for level in (50, 90):
        band = bands[str(level)]
        assert float(band.get_attribute("data-lower")) == pytest.approx(row[f"lower_{level}"], rel=1e-9)
        assert float(band.get_attribute("data-upper")) == pytest.approx(row[f"upper_{level}"], rel=1e-9)
    y = {b: (float(bands[b].get_attribute("y")), float(bands[b].get_attribute("height"))) for b in ("50", "90")}
    assert y["90"][0] <= y["50"][0] and y["50"][0] + y["50"][1] <= y["90"][0] + y["90"][1] + 1e-6  # 50% inside 90%
    cy = float(bands["point"].get_attribute("cy"))
    assert y["50"][0] - 1e-6 <= cy <= y["50"][0] + y["50"][1] + 1e-6  # the value inside its 50% band
    series = d.find_element(By.ID, "series").get_attribute("value")
    assert len(bands["context"].get_attribute("points").split()) == len(re.split(r"[\s,;]+", series.strip()))
    cells = [c.text for c in d.find_elements(By.CSS_SELECTOR, "#predict-table tbody td")]
    assert close_value(shown(cells[2]), row["value"]) and close(shown(cells[5]), row["p_num"])
    for col, level in ((3, 50), (4, 90)):
        lo, hi = shown_interval(cells[col])
        assert close_value(lo, row[f"lower_{level}"]) and close_value(hi, row[f"upper_{level}"])
    screenshot(d, tmp_path / "predict.png", "playground-predict.png")


def svg_points(polygon) -> list[tuple[float, float]]:
    """An SVG polygon's or polyline's points attribute ("x,y x,y ...") as (x, y) pairs."""
    return [tuple(map(float, p.split(","))) for p in polygon.get_attribute("points").split()]


@needs_browser
def test_predict_draws_the_bands_and_fans_at_the_bounds_of_the_api(server, browser):
    """The drawn geometry, not only the data attributes: the plot's y axis is linear, so the 90% band's drawn height
    over the 50% band's is the ratio of the API's interval widths, each band sits where its bounds are, and each fan
    runs from the last context point to its own band's top and bottom."""
    d = browser
    open_page(d, server)
    d.find_element(By.ID, "tab-predict").click()
    prompt = json.loads(d.find_element(By.ID, "series-prompt").text)
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]"), "the plot")
    row = api(server, "/v1/predict", {"model": "a", "prompts": [prompt]}).json()["data"][0]
    svg = d.find_element(By.CSS_SELECTOR, "#plot svg")
    width = {level: row[f"upper_{level}"] - row[f"lower_{level}"] for level in (50, 90)}
    assert all(map(math.isfinite, width.values())) and width[90] > width[50] > 0  # a: finite, nested intervals

    band = {}  # level: (top, height) as drawn, in the plot's viewBox units (its pixels)
    for level in (50, 90):
        rect = svg.find_element(By.CSS_SELECTOR, f"rect[data-band='{level}']")
        band[level] = float(rect.get_attribute("y")), float(rect.get_attribute("height"))
    # the 50% band taller than the page's 1-pixel minimum: the ratio below is of drawn widths, not of the minimum
    assert band[50][1] > 5, band
    ratio = width[90] / width[50]
    assert band[90][1] == pytest.approx(band[50][1] * ratio, abs=1.0), (band, ratio)
    # where: pixels per unit from the 50% band, the 90% band's edges and the point placed by the API's numbers
    scale = band[50][1] / width[50]
    top = {level: band[50][0] - (row[f"upper_{level}"] - row["upper_50"]) * scale for level in (50, 90)}
    assert band[90][0] == pytest.approx(top[90], abs=1.0), (band, top)
    cy = float(svg.find_element(By.CSS_SELECTOR, "[data-band=point]").get_attribute("cy"))
    assert cy == pytest.approx(band[50][0] + (row["upper_50"] - row["value"]) * scale, abs=1.0)

    last = svg_points(svg.find_element(By.CSS_SELECTOR, "[data-band=context]"))[-1]
    for level in (50, 90):
        fan = svg.find_elements(By.CSS_SELECTOR, f"polygon[data-fan='{level}']")
        assert len(fan) == 1, f"{len(fan)} fans for the {level}% band"
        points = svg_points(fan[0])
        assert len(points) == 3 and points[0] == pytest.approx(last)  # from the window's last value
        y_top, height = band[level]
        assert [y for _, y in points[1:]] == pytest.approx([y_top, y_top + height], abs=1e-6), (level, points, band)


@needs_browser
def test_errors_of_the_server_show_as_messages(server, browser):
    d = browser
    open_page(d, server)
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("10000000")  # beyond the base's context: the server's 400
    d.find_element(By.ID, "run").click()
    box = wait(d, lambda d: d.find_element(By.ID, "error") if d.find_element(By.ID, "error").is_displayed() else None,
               "the error message")
    r = api(server, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 10_000_000,
                                        "mode": "deterministic", "stream": True})
    assert r.status_code == 400
    assert box.text == f"Error 400: {r.json()['error']['message']}" and "context" in box.text
    assert d.find_element(By.ID, "run").is_enabled()  # the page goes on
    d.find_element(By.ID, "tab-predict").click()
    d.find_element(By.CSS_SELECTOR, "input[name=pkind][value=series]").click()
    series = d.find_element(By.ID, "series")
    series.clear()
    series.send_keys("1, 2, x")
    d.find_element(By.ID, "predict").click()
    assert "is not a number" in box.text


@needs_browser
def test_fits_a_phone_and_stays_on_its_origin(server, browser, tmp_path):
    d = browser
    d.set_window_size(390, 844)
    open_page(d, server)
    d.find_element(By.ID, "tab-predict").click()
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]"), "the plot")
    assert d.execute_script("return window.innerWidth") <= 400
    assert d.execute_script("return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    assert d.find_element(By.CSS_SELECTOR, "#plot svg").size["width"] <= 390
    d.save_screenshot(str(tmp_path / "phone.png"))
    # every request the page made went to the server it came from
    origin = server.url
    resources = d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(u.startswith(origin + "/") for u in resources), resources
    sent = [json.loads(e["message"])["message"] for e in d.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"]
    assert any(u.endswith("/v1/predict") for u in urls)
    assert all(u.startswith(origin + "/") or u.startswith("data:") for u in urls), urls


@needs_browser
def test_predict_draws_the_fan_of_a_horizon(server, browser):
    """Steps ahead > 1: the page asks /v1/predict for a horizon (the separator written between the values) and draws
    the fan over the H steps at the API's bounds, the path's values as points, one table row per step."""
    d = browser
    open_page(d, server)
    d.find_element(By.ID, "tab-predict").click()
    d.find_element(By.CSS_SELECTOR, "input[name=pkind][value=series]").click()
    prompt = json.loads(d.find_element(By.ID, "series-prompt").text)
    steps = d.find_element(By.ID, "series-horizon")
    steps.clear()
    steps.send_keys("4")
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]")) == 4, "the fan")
    sep = d.find_element(By.ID, "series-sep").get_attribute("value")
    want = api(server, "/v1/predict", {"model": "a", "prompts": [prompt], "horizon": 4, "paths": 100,
                                       "continuations": [[sep] * 3]}).json()["data"][0]["horizon"]
    svg = d.find_element(By.CSS_SELECTOR, "#plot svg")
    points = svg.find_elements(By.CSS_SELECTOR, "[data-band=point]")
    assert [float(p.get_attribute("data-value")) for p in points] == pytest.approx([s["value"] for s in want], rel=1e-9)
    for level in (50, 90):
        band = svg.find_element(By.CSS_SELECTOR, f"polygon[data-band='{level}']")
        for side in ("lower", "upper"):
            got = [float(x) for x in band.get_attribute(f"data-{side}").split()]
            assert got == pytest.approx([s[f"{side}_{level}"] for s in want], rel=1e-9)
        assert len(svg_points(band)) == 1 + 2 * 4  # from the last value, through the 4 upper and 4 lower bounds
    rows = d.find_elements(By.CSS_SELECTOR, "#predict-table tbody tr")
    assert len(rows) == 4
    assert close_value(shown(rows[3].find_elements(By.TAG_NAME, "td")[2].text), want[3]["value"])


@needs_browser
def test_horizon_fan_is_drawn_at_the_bounds_of_the_api(server, browser):
    """The horizon fan's drawn geometry, not only its data attributes: each level's polygon runs from the window's last
    value through the API's upper bounds of steps 1..H and back through its lower bounds, every vertex at the y the
    plot's (linear) y scale gives that bound, at the x of its step's point. The y scale is read off the drawing itself
    (the context line's vertices against the window's values, checked on the steps' points)."""
    d = browser
    open_page(d, server)
    d.find_element(By.ID, "tab-predict").click()
    d.find_element(By.CSS_SELECTOR, "input[name=pkind][value=series]").click()
    prompt = json.loads(d.find_element(By.ID, "series-prompt").text)
    H = 3
    steps = d.find_element(By.ID, "series-horizon")
    steps.clear()
    steps.send_keys(str(H))
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]")) == H, "the fan")
    sep = d.find_element(By.ID, "series-sep").get_attribute("value")
    want = api(server, "/v1/predict", {"model": "a", "prompts": [prompt], "horizon": H, "paths": 100,
                                       "continuations": [[sep] * (H - 1)]}).json()["data"][0]["horizon"]
    assert all(math.isfinite(s[f"{side}_{level}"]) for s in want for side in ("lower", "upper") for level in (50, 90))
    svg = d.find_element(By.CSS_SELECTOR, "#plot svg")

    # the y scale: y_px = a + b * value, fitted on the context line (the window's values as drawn)
    series = [float(v) for v in re.split(r"[\s,;]+", d.find_element(By.ID, "series").get_attribute("value").strip())]
    context = svg_points(svg.find_element(By.CSS_SELECTOR, "[data-band=context]"))
    assert len(context) == len(series) and max(series) > min(series)
    i, j = series.index(max(series)), series.index(min(series))
    b = (context[i][1] - context[j][1]) / (series[i] - series[j])
    a = context[i][1] - b * series[i]
    assert b < 0  # up is larger

    def ys(v):
        return a + b * v

    for v, (_, y) in zip(series, context):
        assert y == pytest.approx(ys(v), abs=1e-6)
    dots = svg.find_elements(By.CSS_SELECTOR, "[data-band=point]")
    xs = [float(p.get_attribute("cx")) for p in dots]
    for p, s in zip(dots, want):  # the scale places the steps' values where their points are drawn
        assert float(p.get_attribute("cy")) == pytest.approx(ys(s["value"]), abs=1e-6)

    drawn = {}
    for level in (50, 90):
        points = svg_points(svg.find_element(By.CSS_SELECTOR, f"polygon[data-band='{level}']"))
        assert len(points) == 1 + 2 * H and points[0] == pytest.approx(context[-1])
        upper, lower = points[1:1 + H], points[1 + H:][::-1]
        assert [x for x, _ in upper] == pytest.approx(xs) and [x for x, _ in lower] == pytest.approx(xs)
        for side, vertices in (("upper", upper), ("lower", lower)):
            got = [y for _, y in vertices]
            assert got == pytest.approx([ys(s[f"{side}_{level}"]) for s in want], abs=1e-6), (level, side, got)
        drawn[level] = upper, lower
    # the 90% fan encloses the 50% fan wherever the API's intervals nest
    for h, s in enumerate(want):
        assert drawn[90][0][h][1] <= drawn[50][0][h][1] + 1e-9 and drawn[50][1][h][1] <= drawn[90][1][h][1] + 1e-9


# ----------------------------------------------------------------------------- the horizon, read as a user would
#: where the page's screenshot of a 6-step horizon goes besides the test's tmp_path (a fixed path to look at)
HORIZON_SHOT = Path(os.environ.get("CAUSAL_ADAPTER_HORIZON_SHOT", "/tmp/playground-horizon.png"))


def horizon_on_page(d, server, H, adapter="a"):
    """The page (at the desktop size) asked for an H-step horizon of its default series; the API's steps for the same
    request."""
    d.set_window_size(1100, 900)
    open_page(d, server, adapter)
    d.find_element(By.ID, "tab-predict").click()
    d.find_element(By.CSS_SELECTOR, "input[name=pkind][value=series]").click()
    prompt = json.loads(d.find_element(By.ID, "series-prompt").text)
    steps = d.find_element(By.ID, "series-horizon")
    steps.clear()
    steps.send_keys(str(H))
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]")) == H, "the fan")
    body = {"model": adapter, "prompts": [prompt]}
    if H > 1:
        sep = d.find_element(By.ID, "series-sep").get_attribute("value")
        body.update(horizon=H, paths=100, continuations=[[sep] * (H - 1)])
    row = api(server, "/v1/predict", body).json()["data"][0]
    return row["horizon"] if H > 1 else row


def table(d, table_id):
    """(header texts, rows of cell elements) of one of the page's tables."""
    heads = [th.text for th in d.find_elements(By.CSS_SELECTOR, f"#{table_id} thead th")]
    rows = [tr.find_elements(By.TAG_NAME, "td") for tr in d.find_elements(By.CSS_SELECTOR, f"#{table_id} tbody tr")]
    return heads, rows


@needs_browser
def test_horizon_marks_each_uncalibrated_step(server, browser, tmp_path):
    """Adapter a has a one-step map and no per-step maps (as the demo's adapter): the API says step 1 is calibrated
    and steps 2..6 are not (the paths' raw intervals); the page marks each of those steps (a badge in its table row, a
    hollow point in the fan) and says so in a line under the fan. A one-step prediction shows no such line."""
    d = browser
    want = horizon_on_page(d, server, 6)
    assert [s["calibrated"] for s in want] == [True] + [False] * 5
    assert [s["intervals"] for s in want] == ["calibrated"] + ["raw"] * 5
    rows = d.find_elements(By.CSS_SELECTOR, "#predict-table tbody tr")
    assert [r.get_attribute("data-calibrated") for r in rows] == ["true"] + ["false"] * 5
    for r, s in zip(rows, want):
        badges = r.find_elements(By.CSS_SELECTOR, "td .badge")
        if s["calibrated"]:
            assert not badges, f"step {s['step']} is calibrated, yet marked"
        else:
            assert len(badges) == 1 and badges[0].is_displayed() and badges[0].text == "uncalibrated", s["step"]
            assert "raw" in badges[0].get_attribute("title")
    note = d.find_element(By.ID, "plot-note")
    assert note.is_displayed(), "no line under the fan"
    assert note.text.startswith("Steps 2\u20136: uncalibrated intervals") and "raw" in note.text, note.text
    points = d.find_elements(By.CSS_SELECTOR, "#plot svg [data-band=point]")
    assert [p.get_attribute("data-calibrated") for p in points] == ["true"] + ["false"] * 5
    assert {p.get_attribute("fill") for p in points[1:]} == {"#fff"}  # hollow
    assert d.find_element(By.ID, "legend-uncalibrated").is_displayed()
    screenshot(d, tmp_path / "horizon.png")
    shutil.copy(tmp_path / "horizon.png", HORIZON_SHOT)

    horizon_on_page(d, server, 1)  # one step: calibrated, nothing to say
    assert not d.find_element(By.ID, "plot-note").is_displayed()
    assert not d.find_element(By.ID, "legend-uncalibrated").is_displayed()


VALUE_TEXT = re.compile(rf"-?\d+\.\d{{{DECIMALS}}}|\u221e|\u2212\u221e")


def at_decimals(text):
    """A value as the page prints it at the adapter's decimals: exactly `DECIMALS` of them (or an unbounded side)."""
    assert VALUE_TEXT.fullmatch(text), f"{text!r} is not written with the adapter's {DECIMALS} decimal(s)"
    return shown(text)


@needs_browser
def test_values_and_bounds_are_printed_at_the_adapters_decimals(server, browser):
    """/v1/models says each adapter's value_decimals (the toy adapters' data: one decimal); the page prints every
    value and bound at them: the horizon table, the one-step table and the numbers of a completion."""
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert {m["id"]: m["value_decimals"] for m in models["data"]} == {"a": DECIMALS, "b": DECIMALS}
    d = browser
    want = horizon_on_page(d, server, 6)
    _, rows = table(d, "predict-table")
    for cells, s in zip(rows, want):
        assert close_value(at_decimals(cells[2].text), s["value"])
        for col, level in ((3, 50), (4, 90)):
            lo, hi = shown_interval(cells[col].text)
            lo_text, hi_text = cells[col].text[1:-1].split(", ")
            assert close_value(at_decimals(lo_text), s[f"lower_{level}"]) and lo == shown(lo_text)
            assert close_value(at_decimals(hi_text), s[f"upper_{level}"]) and hi == shown(hi_text)
    row = horizon_on_page(d, server, 1)
    _, (cells,) = table(d, "predict-table")
    assert close_value(at_decimals(cells[2].text), row["value"])
    for col in (3, 4):
        assert all(VALUE_TEXT.fullmatch(x) for x in cells[col].text[1:-1].split(", ")), cells[col].text

    d.find_element(By.ID, "tab-complete").click()
    d.find_element(By.CSS_SELECTOR, "input[name=kind][value=prompt]").click()
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))
    d.find_element(By.ID, "run").click()
    wait(d, lambda d: "written" in d.find_element(By.ID, "complete-status").text, "the completion")
    _, rows = table(d, "values-table")
    assert rows
    for cells in rows:
        for cell in cells[1:3]:  # the 50% and 90% intervals
            for x in cell.text[1:-1].split(", "):
                at_decimals(x)
    button = d.find_element(By.CSS_SELECTOR, "#output button.num")
    d.execute_script("arguments[0].focus()", button)
    tip = wait(d, lambda d: d.find_element(By.ID, "tip") if d.find_element(By.ID, "tip").is_displayed() else None,
               "the tooltip")
    field = {e.get_attribute("data-field"): e.text for e in tip.find_elements(By.TAG_NAME, "dd")}
    at_decimals(field["value"])
    for x in field["interval-50"][1:-1].split(", ") + field["interval-90"][1:-1].split(", "):
        at_decimals(x)


def y_scale(d, svg):
    """The plot's y scale, y_px = a + b * value, read off the context line (the window's values as drawn)."""
    series = [float(v) for v in re.split(r"[\s,;]+", d.find_element(By.ID, "series").get_attribute("value").strip())]
    context = svg_points(svg.find_element(By.CSS_SELECTOR, "[data-band=context]"))
    i, j = series.index(max(series)), series.index(min(series))
    b = (context[i][1] - context[j][1]) / (series[i] - series[j])
    return context[i][1] - b * series[i], b


@needs_browser
@pytest.mark.parametrize("H", [6, 1])
def test_plot_has_round_y_ticks_and_axis_titles(server, browser, H):
    """The y axis' tick labels are round numbers: at least three, a step of 1, 2 or 5 times a power of ten, each a
    multiple of it, written with no more decimals than the step needs, each drawn at the height the plot's scale gives
    its value; the x axis is titled "step" and the y axis "value" (the horizon's fan and the one-step plot)."""
    d = browser
    horizon_on_page(d, server, H)
    svg = d.find_element(By.CSS_SELECTOR, "#plot svg")
    labels = svg.find_elements(By.CSS_SELECTOR, "text[data-tick=y]")
    values = [float(t.text.replace("\u2212", "-")) for t in labels]
    assert len(values) >= 3, [t.text for t in labels]
    steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    assert len(steps) == 1, f"uneven ticks {values}"
    step = steps.pop()
    power = 10 ** math.floor(math.log10(step))
    assert round(step / power, 9) in (1, 2, 5), f"tick step {step} is not 1, 2 or 5 times a power of ten: {values}"
    decimals = max(0, -math.floor(math.log10(step)))
    for t, v in zip(labels, values):
        assert abs(v / step - round(v / step)) < 1e-6, f"tick {t.text} is not a multiple of {step}"
        assert len(t.text.partition(".")[2]) == decimals, f"tick {t.text!r}: {decimals} decimals for a step of {step}"
    a, b = y_scale(d, svg)
    for t, v in zip(labels, values):  # each label beside the grid line of its value (the text's baseline 4px below)
        assert float(t.get_attribute("y")) - 4 == pytest.approx(a + b * v, abs=1e-6), (t.text, v)
    titles = {t.get_attribute("data-axis"): t for t in svg.find_elements(By.CSS_SELECTOR, "text[data-axis]")}
    assert set(titles) == {"x", "y"} and titles["x"].text == "step" and titles["y"].text == "value"
    assert all(t.is_displayed() for t in titles.values())
    assert "rotate(-90" in titles["y"].get_attribute("transform")  # along its axis


@needs_browser
def test_horizon_table_first_column_is_the_step(server, browser):
    """A horizon's table holds one row per step: its first column is headed "Step" (+1 .. +H); rows' predictions are
    headed "Row" again."""
    d = browser
    horizon_on_page(d, server, 3)
    heads, rows = table(d, "predict-table")
    assert heads[0] == "Step", heads
    assert [cells[0].text.split()[0] for cells in rows] == ["+1", "+2", "+3"]
    d.find_element(By.CSS_SELECTOR, "input[name=pkind][value=rows]").click()
    d.find_element(By.ID, "predict").click()
    wait(d, lambda d: table(d, "predict-table")[0][0] == "Row", "the rows' table")
    assert [cells[0].text for cells in table(d, "predict-table")[1]] == ["1", "2"]


@needs_browser
def test_complete_table_shows_each_number_once(server, browser):
    """The Complete table: each number the completion wrote once (its text; its value is what the text says), then
    its intervals and P(<NUM>): no column repeats the number."""
    d = browser
    d.set_window_size(1100, 900)
    open_page(d, server)
    prompt = d.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))
    d.find_element(By.ID, "run").click()
    wait(d, lambda d: "written" in d.find_element(By.ID, "complete-status").text, "the completion")
    want = api(server, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                           "mode": "deterministic"}).json()["choices"][0]["values"]
    heads, rows = table(d, "values-table")
    assert heads == ["Number", "50% interval", "90% interval", "P(<NUM>)"], heads
    assert want and len(rows) == len(want)
    for cells, v in zip(rows, want):
        texts = [c.text for c in cells]
        assert texts[0] == v["text"]
        same = [t for t in texts if t == v["text"] or (VALUE_TEXT.fullmatch(t) and shown(t) == float(v["text"]))]
        assert same == [v["text"]], f"the number {v['text']!r} shown more than once: {texts}"
        assert float(cells[0].get_attribute("title").split()[-1]) == v["value"]  # the exact value, on hover
