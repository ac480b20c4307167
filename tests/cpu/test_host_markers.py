"""The host markers the CI selects by (tests/conftest.py): a test that imports a host engine must carry
that host's marker, and a host the run requires cannot be skipped away."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
INI = """[pytest]
markers =
    vllm: needs vllm
    sglang: needs sglang
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini(INI)
    pytester.makepyfile(vllm="")  # a stand-in where vLLM is not installed; only the import's name counts
    return pytester


def outcomes(result) -> dict[str, str]:
    return {r.nodeid.split("::", 1)[1]: r.outcome for r in result.reprec.getreports("pytest_runtest_logreport")
            if r.when == "call" or not r.passed}


def test_a_test_importing_a_host_without_its_marker_fails_naming_the_marker(suite):
    suite.makepyfile(test_body="""
        import pytest

        def test_unmarked():
            import vllm

        def test_unmarked_from_import():
            from vllm import __name__ as name

        @pytest.mark.vllm
        def test_marked():
            import vllm

        @pytest.mark.parametrize("host", [pytest.param("vllm", marks=pytest.mark.vllm), "sglang_free"])
        def test_marked_per_case(host):
            if host == "vllm":
                import vllm

        def test_no_host():
            import json
    """)
    result = suite.runpytest("-p", "no:cacheprovider")
    assert outcomes(result) == {"test_unmarked": "failed", "test_unmarked_from_import": "failed",
                                "test_marked": "passed", "test_marked_per_case[vllm]": "passed",
                                "test_marked_per_case[sglang_free]": "passed", "test_no_host": "passed"}
    result.stdout.fnmatch_lines(["*test_unmarked imports vllm but is not marked @pytest.mark.vllm*"])


def test_imports_at_module_level_through_importorskip_and_in_fixtures_count(suite):
    suite.makepyfile(
        test_module_level="""
            import pytest
            pytest.importorskip("vllm")

            def test_in_a_host_module():
                pass
        """,
        test_fixtures="""
            import pytest

            @pytest.fixture(scope="module")
            def host_config():
                import vllm
                return vllm

            def test_first(host_config):
                pass

            def test_second_uses_the_cached_fixture(host_config):
                pass

            @pytest.mark.vllm
            def test_marked(host_config):
                pass
        """,
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    assert outcomes(result) == {"test_in_a_host_module": "failed", "test_first": "failed",
                                "test_second_uses_the_cached_fixture": "failed", "test_marked": "passed"}


def test_a_required_host_that_does_not_import_fails_instead_of_skipping(suite, monkeypatch):
    suite.makepyfile(
        test_whole="import pytest\npytest.importorskip('bcg_no_such_host')\ndef test_a(): pass\n",
        test_part="import pytest\ndef test_b():\n    pytest.importorskip('bcg_no_such_host.sub')\n",
    )
    monkeypatch.delenv("BCG_REQUIRED_HOSTS", raising=False)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2)  # the control: a plain run skips
    monkeypatch.setenv("BCG_REQUIRED_HOSTS", "vllm, bcg_no_such_host")
    result = suite.runpytest("-p", "no:cacheprovider")  # a module that skips at import stops the run
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*bcg_no_such_host does not import, and BCG_REQUIRED_HOSTS requires it*"])
    result = suite.runpytest("-p", "no:cacheprovider", "--continue-on-collection-errors")
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(["*bcg_no_such_host.sub does not import, and BCG_REQUIRED_HOSTS requires it*"])
