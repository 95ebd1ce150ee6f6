"""Torch threads for serving (core.threads): the rule over cores, engines, backends and
where the model runs, and the overrides that take precedence."""

from __future__ import annotations

import pytest

from neuron_plugin.core.threads import (
    API_SERVER,
    ENGINE,
    RUNNER,
    THREADS_ENV,
    cgroup_cpu_limit,
    serves_api,
    serving_threads,
)


# role, cores, engines, model on host, runner, threads
RULE = [
    # the reference backend in the engine core: every core but the API server's
    (API_SERVER, 2, 1, True, False, 1),
    (ENGINE, 2, 1, True, False, 1),
    (ENGINE, 8, 1, True, False, 7),
    (ENGINE, 9, 2, True, False, 4),  # two data-parallel engines share 8 cores
    (ENGINE, 1, 1, True, False, 1),  # never below one
    # the reference backend in a runner: the runner computes, its engine core keeps 1
    (RUNNER, 8, 1, True, True, 6),
    (ENGINE, 8, 1, True, True, 1),
    (RUNNER, 2, 1, True, True, 1),
    # NxDI on NeuronCores (inf2.xlarge: 4 vCPUs): host sampling in the engine core
    (ENGINE, 4, 1, False, True, 2),
    (RUNNER, 4, 1, False, True, 1),
    (ENGINE, 4, 1, False, False, 3),
    (API_SERVER, 4, 1, False, True, 1),
]


@pytest.mark.parametrize("role,cores,engines,on_host,runner,threads", RULE)
def test_the_rule_never_asks_for_more_cores_than_there_are(
    role, cores, engines, on_host, runner, threads
):
    choice = serving_threads(
        role, cores=cores, engines=engines, model_on_host=on_host, runner=runner, environ={}
    )
    assert choice.threads == threads, choice.reason
    assert f"{cores} cores" in choice.reason


@pytest.mark.parametrize(
    "cores,engines,on_host,runner",
    [
        (c, d, h, r)
        for c in (1, 2, 3, 4, 8, 16, 64)
        for d in (1, 2, 4)
        for h in (True, False)
        for r in (True, False)
    ],
)
def test_all_serving_processes_together_fit_the_host(cores, engines, on_host, runner):
    """The API server, each engine core and each runner: their threads sum to at most the
    cores (when every process can have one)."""

    def threads(role):
        choice = serving_threads(
            role, cores=cores, engines=engines, model_on_host=on_host, runner=runner, environ={}
        )
        assert choice.threads is not None
        return choice.threads

    total = threads(API_SERVER) + engines * (threads(ENGINE) + (threads(RUNNER) if runner else 0))
    processes = 1 + engines * (2 if runner else 1)
    assert total <= max(cores, processes)


def test_an_explicit_omp_num_threads_is_kept():
    choice = serving_threads(ENGINE, cores=8, environ={"OMP_NUM_THREADS": "3"})
    assert choice.threads is None and "OMP_NUM_THREADS=3 is set" in choice.reason
    # the count vLLM itself put there for a worker is not the user's choice
    vllm = serving_threads(
        ENGINE, cores=8, environ={"OMP_NUM_THREADS": "8", "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"}
    )
    assert vllm.threads == 7


def test_the_plugin_variable_sets_the_computing_process_only():
    env = {THREADS_ENV: "5"}
    assert serving_threads(ENGINE, cores=2, environ=env).threads == 5
    assert serving_threads(API_SERVER, cores=2, environ=env).threads == 1
    assert serving_threads(ENGINE, cores=2, runner=True, environ=env).threads == 1
    assert serving_threads(RUNNER, cores=2, runner=True, environ=env).threads == 5
    with pytest.raises(ValueError, match=f"{THREADS_ENV}='many' is not a whole number >= 1"):
        serving_threads(ENGINE, cores=2, environ={THREADS_ENV: "many"})


def test_cgroup_quota(tmp_path):
    assert cgroup_cpu_limit(tmp_path) is None  # no cgroup files
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.0  # at least one core


def test_the_api_server_is_vllm_serves_main_process_with_its_engine_elsewhere():
    assert serves_api(["/venv/bin/vllm", "serve", "m"], {}, child=False)
    # its engine core inherits the command line and resolves the settings again
    assert not serves_api(["/venv/bin/vllm", "serve", "m"], {}, child=True)
    assert not serves_api(
        ["/venv/bin/vllm", "serve", "m"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, child=False
    )
    assert not serves_api(["script.py"], {}, child=False)
    assert not serves_api(["/venv/bin/vllm", "bench", "serve"], {}, child=False)
