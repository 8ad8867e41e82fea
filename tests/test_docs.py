"""The documentation stays true to the code: the generated files are current, and every relative link leads to a file.

configs/default.toml and docs/configuration.md are written by scripts/write_default_config.py from the docstrings of
ppo_core/config.py; here both are rendered again in memory and compared with the files, comments included.
"""
import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = "stale: run `python scripts/write_default_config.py` and commit the result"


def _generator():
    spec = importlib.util.spec_from_file_location("write_default_config",
                                                  os.path.join(ROOT, "scripts", "write_default_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_default_toml_is_what_the_generator_writes():
    assert _read("configs", "default.toml") == _generator().render(), f"configs/default.toml is {REGENERATE}"


def test_configuration_doc_is_what_the_generator_writes():
    assert _read("docs", "configuration.md") == _generator().render_doc(), f"docs/configuration.md is {REGENERATE}"


def test_configuration_doc_names_every_field():
    from ppo_core.config import PPOConfig
    import dataclasses
    doc = _read("docs", "configuration.md")
    missing = [f.name for f in dataclasses.fields(PPOConfig) if f"**`{f.name}`**" not in doc]
    assert not missing, missing


DOC_FILES = sorted(["README.md"] + [os.path.relpath(p, ROOT) for p in
                                    glob.glob(os.path.join(ROOT, "docs", "*.md"))
                                    + glob.glob(os.path.join(ROOT, "bench", "results", "*.md"))])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # fenced blocks and inline code hold no links


def _relative_links(text):
    for target in LINK.findall(CODE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http:, mailto:, same-page anchors
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("doc", DOC_FILES)
def test_relative_links_point_to_files(doc):
    here = os.path.dirname(os.path.join(ROOT, doc))
    broken = [t for t in _relative_links(_read(doc)) if not os.path.exists(os.path.normpath(os.path.join(here, t)))]
    assert not broken, f"{doc}: links to missing files: {broken}"


def test_the_docs_exist_and_readme_is_a_front_page():
    assert len(_read("README.md").splitlines()) <= 320, "the README is a front page: move detail to docs/"
    assert os.path.exists(os.path.join(ROOT, "bench", "results", "README.md"))


# ---------------------------------------------------------------------------- issue 47: what the docs promise

def _words(*parts):
    return " ".join(_read(*parts).split())


def test_readme_says_how_many_threads_the_default_job_uses():
    """It said "the default job trains in under a minute on two cores" while `threads` defaults to 1."""
    from ppo_core.config import PPOConfig

    assert PPOConfig().threads == 1
    readme = _words("README.md")
    assert "the default job trains in under a minute on one core (one torch thread, the default `threads`" in readme
    assert "on two cores." not in readme


def test_readme_gives_the_test_suites_time():
    assert re.search(r"Run the test suite \([^)]*~\d+(-\d+)? min on 2 cores\)", _words("README.md"))


def test_the_docs_describe_the_sandboxs_memory_bound_as_the_code_does():
    """docs/agents.md said the sandbox does not bound total memory across processes (no cgroup); the code bounds a
    call as a whole where it can make a memory cgroup (ppo_core/rewards/sandbox.py), as the README and
    docs/reliability.md say."""
    assert "the bound on a call as a whole is memory_mb only where it runs in a cgroup" in _words(
        "ppo_core", "rewards", "sandbox.py")
    for doc in (("README.md",), ("docs", "agents.md"), ("docs", "reliability.md")):
        assert "no cgroup" not in _words(*doc), doc
    agents = _words("docs", "agents.md")
    assert "`memory_mb` bounds a call's processes together where a memory cgroup can be made" in agents


def test_the_trl_versions_named_are_those_the_bench_scripts_use():
    """The `bench` extra pins the TRL of bench/e2e.py's PPOTrainer; the README's GRPOTrainer comparison used another,
    installed by bench/trl_grpo.py's own instructions: both named where they are used."""
    def minor(version):
        return ".".join(version.split(".")[:2])

    ppo_trl = minor(re.search(r'"bench": \["trl==([\d.]+)"', _read("setup.py")).group(1))
    grpo_trl = minor(re.search(r"pip install trl==([\d.]+)", _read("bench", "trl_grpo.py")).group(1))
    readme = _words("README.md")
    assert f"TRL {ppo_trl}'s PPOTrainer" in _words("bench", "e2e.py")
    assert f"| TRL {grpo_trl} GRPOTrainer," in readme and f"ran TRL {grpo_trl} in a venv of its own" in readme
    assert f"the `bench` extra pins TRL {ppo_trl}, the last with a PPOTrainer" in readme
