"""pipeline.registry without a store: the one parser of `models:/` URIs, and mlflow kept out of light imports."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.registry import RegistryError, RegistryURI, parse_uri
from pipeline.sources import SourceError, locate

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("source, expected", [
    ("models:/draftops-draft@champion", RegistryURI("draftops-draft", alias="champion")),
    ("models:/draftops-draft@previous-champion", RegistryURI("draftops-draft", alias="previous-champion")),
    ("models:/draftops-draft/12", RegistryURI("draftops-draft", version="12")),
    ("models:/team/draft/3", RegistryURI("team/draft", version="3")),  # the version follows the last slash
])
def test_registry_uris_parse_to_name_and_alias_or_version(source, expected):
    assert parse_uri(source) == expected


@pytest.mark.parametrize("source, reason", [
    ("models:/", "no model name"),
    ("models:/@champion", "no model name"),
    ("models:/draft", "neither an alias nor a version"),
    ("models:/draft@", "no alias"),
    ("models:/draft/", "version '' is not a number"),
    ("models:/draft/notanumber", "version 'notanumber' is not a number"),
    ("models:/draft/latest", "version 'latest' is not a number"),
    ("runs:/0123abcd/draft", "not a registry URI"),
    ("/checkpoints/draft", "not a registry URI"),
])
def test_malformed_registry_uris_are_refused_with_the_reason(source, reason):
    forms = "(models:/NAME@ALIAS or models:/NAME/VERSION)"
    with pytest.raises(RegistryError, match=re.escape(f"{source}: {reason} {forms}")):
        parse_uri(source)


def test_built_uris_parse_back():
    assert registry.alias_uri("draft", "champion") == "models:/draft@champion"
    assert registry.version_uri("draft", "7") == "models:/draft/7"
    assert parse_uri(registry.version_uri("draft", "7")) == RegistryURI("draft", version="7")


def test_a_malformed_uri_is_a_source_error_before_any_store_is_asked():
    with pytest.raises(SourceError, match="models:/draft/x: version 'x' is not a number"):
        locate("models:/draft/x")


def test_link_run_leaves_sources_outside_the_registry_alone():
    assert registry.link_run("/checkpoints/draft", "draftops.latest_eval_run", "0123abcd") is None


def test_the_command_line_modules_do_not_import_mlflow():
    """`draftops` imports monitor.registry_report to build its parser and pipeline.sources for `models info`: neither
    may pull mlflow (seconds) in through the registry."""
    code = "import sys, monitor.registry_report, pipeline.sources; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
