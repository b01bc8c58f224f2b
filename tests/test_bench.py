"""The benchmark's in-process paths (no Flower): they must drive the same client code as a run."""

import json

import pytest
import torch

from fedbr_flwr.bench import command as bench
from fedbr_flwr.launch.plan import config_from_settings


@pytest.mark.parametrize("strategy", ["fedavg", "fedbr", "distrans", "fedmix", "vhl", "scaffold"])
def test_bare_loop_runs_the_clients_fit_and_averages(strategy, monkeypatch):
    cfg = config_from_settings(
        {"strategy": strategy, "num-clients": 2, "local-steps": 1, "batch-size": 4, "device": "cpu"}
    )
    fits = []
    original = bench.client_class(strategy).fit

    def counting_fit(self, parameters, config):
        fits.append((self.pid, config["server-round"], any(k.endswith("-payload") for k in config)))
        return original(self, parameters, config)

    monkeypatch.setattr(bench.client_class(strategy), "fit", counting_fit)
    times, peak_mb = bench.bare_loop_round_seconds(cfg, rounds=1)
    assert len(times) == 1 and times[0] > 0 and peak_mb > 50  # round 1 is the untimed warm-up
    assert [(pid, r) for pid, r, _ in fits] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    # the broadcast data (FedBR's pseudo-data, FedMix's means, VHL's virtual data) rides in round 1 only
    broadcasts = strategy in ("fedbr", "fedmix", "vhl")
    assert [payload for *_, payload in fits] == ([True, True, False, False] if broadcasts else [False] * 4)


def test_the_bare_loop_sends_and_moves_scaffolds_control_variate_as_its_strategy_does(monkeypatch):
    """The server's c goes to every client beside the model, and the clients' changes move it."""
    from fedbr_flwr.bench.bare import bare_loop

    cfg = config_from_settings(
        {"strategy": "scaffold", "num-clients": 2, "local-steps": 2, "batch-size": 4, "device": "cpu"}
    )
    sent = []
    original = bench.client_class("scaffold").fit

    def recording_fit(self, parameters, config):
        sent.append({k: v for k, v in parameters.items() if k.startswith("control/")})
        return original(self, parameters, config)

    monkeypatch.setattr(bench.client_class("scaffold"), "fit", recording_fit)
    bare_loop(cfg, 2, torch.device("cpu"))
    assert len(sent) == 4 and all(len(c) > 0 for c in sent)
    assert all(not c.any() for c in sent[0].values())  # round 1: c = 0
    assert any(c.any() for c in sent[2].values())  # round 2: moved by round 1's changes


@pytest.mark.parametrize("strategy", ["fedmix", "vhl", "scaffold", "fedcm", "feddyn"])
def test_a_fit_is_counted_for_algorithms_that_need_what_the_server_sends(strategy):
    """FedMix's means, VHL's virtual data, SCAFFOLD's control variate, FedCM's direction, FedDyn's alpha_k: the
    counted fit is sent what the strategy sends in round 1, so it runs, at least FedAvg's work."""

    def flops(name):
        settings = {"strategy": name, "num-clients": 2, "local-steps": 1, "batch-size": 4, "model": "cnn-small"}
        return bench.fit_flops(config_from_settings({**settings, "device": "cpu"}))

    fedavg, counted = flops("fedavg"), flops(strategy)
    assert counted >= fedavg > 0
    if strategy in ("fedmix", "vhl"):  # an input gradient in the loss; a virtual batch beside the local one
        assert counted > 1.5 * fedavg


def test_step_benchmark_times_both_algorithms_on_synthetic_cifar_shapes():
    cfg = config_from_settings(
        {"dataset": "cifar10", "data-dir": "unused", "model": "cnn", "batch-size": 2, "device": "cpu"}
    )
    torch.manual_seed(0)
    t = bench.step_seconds(cfg, steps=1, repeats=1)
    assert set(t) == {"fedavg", "fedbr", "distrans"} and all(v > 0 for v in t.values())


def test_step_benchmark_needs_no_data_dir(capsys):
    assert bench.main(["--step", "--steps", "1", "dataset=cifar10", "model=cnn", "batch-size=2"]) == 0
    printed = capsys.readouterr().out
    assert "| FedBR (rsm) |" in printed and "| DisTrans (simultaneous) |" in printed


def test_cohort_step_benchmark_times_loop_and_vmap_and_graph_only_on_cuda(capsys, tmp_path):
    out = tmp_path / "cohort.json"
    assert (
        bench.main(
            [
                "--cohort-step",
                "--rounds",
                "1",
                "--json",
                str(out),
                "device=cpu",
                "num-clients=2",
                "local-steps=1",
                "batch-size=4",
                "model=cnn-small",
                "strategy=fedbr",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| loop (clients one after another) |" in printed and "| vmap (all clients at once) |" in printed
    assert "graph" not in printed  # a CPU has no CUDA graphs
    figures = json.loads(out.read_text())
    assert figures["clients"] == 2 and figures["loop_s_per_round"] > 0 and figures["vmap_s_per_round"] > 0
    assert "graph_s_per_round" not in figures


def test_the_levers_leave_a_cpu_run_bit_identical_except_bf16(capsys, tmp_path):
    """On a CPU the GPU switches (tf32, cuDNN autotuning, the graph step, deterministic algorithms) change nothing:
    every lever's first-round updates equal strict fp32's, and each "again" row its predecessor's, bit for bit.
    bf16 moves them, and by a little so do starting from a global model nudged by one rounding and the matmul
    convolutions (which sum in another order than vmap's grouped ones); a compiled step may, to rounding."""
    out = tmp_path / "levers.json"
    items = ["device=cpu", "num-clients=2", "local-steps=2", "batch-size=4", "model=cnn-small", "strategy=fedbr"]
    assert bench.main(["--levers", "--rounds", "1", "--json", str(out), *items]) == 0
    rows = {row["lever"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(bench.LEVERS) and all(row["s_per_round"] > 0 for row in rows.values())
    assert all(row["first_round_s"] > 0 for row in rows.values())  # the warm-up, where a compiled step compiles
    compiled = {name for name in rows if "compiled step" in name}
    moved = {name for name, row in rows.items() if row["update_distance"] != 0} - compiled
    nudged = "strict fp32, deterministic algorithms, nudged by one rounding"
    matmul = {"strict fp32, matmul convolutions", "tf32 + autotune, matmul convolutions"}
    assert moved == {"bf16 + autotune", nudged, *matmul} and rows["bf16 + autotune"]["update_distance"] < 0.2
    assert all(0 < rows[name]["update_distance"] < 1e-3 for name in (nudged, *matmul))
    assert len(compiled) == 2 and all(rows[name]["update_distance"] < 1e-3 for name in compiled)
    assert "| strict fp32, vmap step, again |" in capsys.readouterr().out
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_lever_that_fails_is_a_row_that_says_why_and_the_others_still_run(monkeypatch, capsys, tmp_path):
    """A lever this machine cannot run (a compiler missing, a step a CUDA graph cannot capture) does not end
    --levers: its row names the error, and the rows after it are measured."""
    levers = {"strict fp32": bench.STRICT, "tf32 + autotune, compiled step": {"compile": True}, "tf32": {"tf32": True}}
    monkeypatch.setattr(bench, "LEVERS", levers)
    real = bench.time_lever

    def no_compiler(cfg, lever, rounds):
        if lever.get("compile"):
            raise RuntimeError("InductorError: no C++ compiler found\nmore lines")
        return real(cfg, lever, rounds)

    monkeypatch.setattr(bench, "time_lever", no_compiler)
    out = tmp_path / "levers.json"
    items = ["device=cpu", "num-clients=2", "local-steps=1", "batch-size=4", "model=cnn-small", "strategy=fedavg"]
    assert bench.main(["--levers", "--rounds", "1", "--json", str(out), *items]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["lever"] for row in rows] == list(levers)
    assert rows[1]["error"] == "RuntimeError: InductorError: no C++ compiler found" and "s_per_round" not in rows[1]
    assert rows[2]["s_per_round"] > 0 and rows[2]["update_distance"] == 0  # tf32 does nothing on a CPU
    assert "| tf32 + autotune, compiled step | failed: RuntimeError: InductorError" in capsys.readouterr().out


def test_kernels_lists_where_a_rounds_time_goes_and_sees_the_matmul_convolutions(monkeypatch, capsys, tmp_path):
    """--kernels on a CPU: the operators by their own time, most first, summing to the busy time; with
    cohort-conv=matmul the convolutions are unfolded (im2col) and no convolution's backward runs."""
    monkeypatch.setattr(bench, "KERNEL_ROWS", 1000)  # every operator
    items = ["device=cpu", "num-clients=2", "local-steps=2", "batch-size=4", "model=cnn-small", "engine=cohort"]
    operators, families = {}, {}
    for conv in ("grouped", "matmul"):
        out = tmp_path / f"{conv}.json"
        assert bench.main(["--kernels", "--json", str(out), *items, "cohort-step=vmap", f"cohort-conv={conv}"]) == 0
        figures = json.loads(out.read_text())
        seconds = [row["seconds"] for row in figures["rows"]]
        assert seconds == sorted(seconds, reverse=True) and sum(seconds) == pytest.approx(figures["busy_s"])
        assert 0 < figures["busy_s"] and 0 < figures["wall_s"]
        operators[conv] = {row["operator"] for row in figures["rows"]}
        assert sum(figures["families"].values()) == pytest.approx(figures["busy_s"])
        families[conv] = figures["families"]
    assert "aten::convolution_backward" in operators["grouped"] and "aten::im2col" not in operators["grouped"]
    assert "aten::convolution_backward" not in operators["matmul"] and "aten::im2col" in operators["matmul"]
    assert "im2col, col2im" in families["matmul"] and "im2col, col2im" not in families["grouped"]
    assert families["grouped"]["convolution and matrix arithmetic"] > 0
    out = capsys.readouterr().out
    assert "| operator or kernel (its own device time) |" in out and "| kernel family (by name) |" in out


def test_kernel_families_name_what_a_gpu_rounds_kernels_do():
    """The families of kernels an H100 ran for a FedBR round (names from its --kernels JSON, shortened)."""
    transposes, arithmetic = "NCHW <-> NHWC transposes", "convolution and matrix arithmetic"
    kernels = {
        "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>": transposes,
        "void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false>": transposes,
        "void at::native::elementwise_kernel<128, 2, gpu_kernel_impl_nocast<direct_copy_kernel_cuda>>": "copies",
        "sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32": arithmetic,
        "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688dgrad_analytic_tf32_256x64_16x4_nhwc_align4>": arithmetic,
        "void at::native::conv_depthwise2d_grad_weight_kernel<float, unsigned int>": arithmetic,
        "void at::native::im2col_kernel<float>(long, float const*, long)": "im2col, col2im",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, sum_functor<float, float, float>>>": "reductions",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "other elementwise",
        "void at::native::elementwise_kernel<128, 2, gpu_kernel_impl_nocast<BinaryFunctor<MulFunctor>>>": (
            "other elementwise"
        ),
        "void at::native::RowwiseMomentsCUDAKernel<float>(long, float, float const*)": "other",
    }
    assert {name: bench.kernel_family(name) for name in kernels} == kernels


def test_kernels_without_any_device_time_stop_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(bench, "kernel_rows", lambda cfg: ([], {}, 1.0, 0.0))  # a GPU whose profiler saw no kernels
    assert bench.main(["--kernels", "device=cpu"]) == 1
    assert "the profiler recorded no time on the device" in capsys.readouterr().err


def test_cohort_step_benchmark_without_its_dataset_stops_with_a_message(capsys, tmp_path):
    assert (
        bench.main(
            ["--cohort-step", "dataset=mnist", f"data-dir={tmp_path}", "download=never", "num-clients=2", "device=cpu"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("fedbr-bench: error: dataset 'mnist' not found") and "Traceback" not in err


@pytest.mark.parametrize(
    "mode",
    [
        "--suite",
        "--scale",
        "--step",
        "--cohort-step",
        "--levers",
        "--kernels",
        "--startup=1",
        "--sweep-startup=1",
        "--round-profile",
        None,
    ],
)
def test_every_mode_refuses_an_unknown_key_with_a_message(mode, capsys):
    assert bench.main([*([mode] if mode else []), "no-such-key=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedbr-bench: error:") and "no-such-key" in err and "Traceback" not in err


def test_one_configs_table_shows_both_engines_it_timed(monkeypatch, capsys):
    timed = {
        **dict(bare_s_per_round=0.1, flower_s_per_round=0.2, ratio=2.0, cohort_s_per_round=0.15, cohort_ratio=1.5),
        **dict(flower_setup="2 simulated clients", flower_total_s_incl_startup=3.0, memory="host RSS"),
        **dict(client_peak_mb=700.0, bytes_per_round=1e6),
    }
    monkeypatch.setattr(bench, "compare", lambda cfg, rounds: timed)
    assert bench.main(["model=lenet", "num-clients=2", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[2:] == [  # the cohort engine was timed, then left out of the table
        "| Flower simulation, engine=clients (2 simulated clients) | 0.200 | 2.00 |",
        "| Flower simulation, engine=cohort (nodes and cores as fedbr-run engine=cohort sizes them) | 0.150 | 1.50 |",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "0"], "--rounds 0: give 1 or more"),
        (["--levers", "--rounds", "-1"], "--rounds -1: give 1 or more"),
        (["--step", "--steps", "0"], "--steps 0: give 1 or more"),
        (["--startup", "0"], "--startup 0: give 1 or more"),
        (["--sweep-startup", "0"], "--sweep-startup 0: give 1 or more"),
        (["--step", "--json", "/no/such/folder/x.json"], "not a file that can be written"),
        (["--step", "--json", "."], "not a file that can be written"),
        (["--step", "--report", "."], "--report . is a folder"),
        (["--step", "--report", "/dev/null/b.md"], "--report's folder /dev/null cannot be used"),
        (["--suite", "--step"], "--step, --suite: give one of these modes"),
        (["--levers", "--startup", "2", "--kernels"], "--levers, --kernels, --startup: give one of these modes"),
    ],
)
def test_bad_counts_and_json_paths_stop_before_measuring(args, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_mode", lambda *a: pytest.fail("measured"))
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedbr-bench: error: ") and message in err and err.count("\n") == 1


def test_report_writes_what_the_command_printed_as_its_section_of_the_page(tmp_path, monkeypatch, capsys):
    """Measured figures belong on the benchmark page with the command, commit, machine and wall time that
    produced them: --report writes the printed tables there; run again, the command replaces its own section,
    and another command, or a failed run, leaves the rest of the page as it was."""
    from fedbr_flwr.bench import page as bench_page

    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmark\n\nHand-written text.\n")
    figures = iter(["| a | 1.0 |", "| a | 2.0 |", "| b | 3.0 |"])
    monkeypatch.setattr(bench, "run_mode", lambda *a: print(f"table:\n{next(figures)}") or 0)
    monkeypatch.setattr(bench_page, "git_commit", lambda: "0123456789abcdef-dirty")
    assert bench.main(["--step", "--steps", "3", "--report", str(page), "batch-size=8"]) == 0
    assert "| a | 1.0 |" in capsys.readouterr().out  # still printed
    first = page.read_text()
    assert first.startswith("# Benchmark\n\nHand-written text.\n")
    assert "### `fedbr-bench --step --steps 3 batch-size=8`" in first  # without --report
    assert f"- commit: 0123456-dirty; machine: {bench_page.this_machine()}; date: " in first
    assert "| a | 1.0 |" in first and first.count("<!-- fedbr-bench report bench-") == 1
    assert bench.main(["--step", "--steps", "3", "--report", str(page), "batch-size=8"]) == 0
    second = page.read_text()
    assert "| a | 2.0 |" in second and "| a | 1.0 |" not in second and second.count("<!-- end of fedbr-bench") == 1
    assert bench.main(["--step", f"--report={page}", "batch-size=4"]) == 0
    third = page.read_text()
    assert third.startswith(second) and "| b | 3.0 |" in third and third.count("<!-- end of fedbr-bench") == 2
    monkeypatch.setattr(bench, "run_mode", lambda *a: print("| c | 4.0 |") or 1)
    assert bench.main(["--step", "--report", str(page)]) == 1
    assert page.read_text() == third


def test_the_scale_benchmark_takes_a_cohort_step(monkeypatch, capsys):
    """--scale always runs engine=cohort, so cohort-step=vmap (the GPU script's part 4) must reach the runs."""
    seen = []

    def fake_rounds(cfg, rounds, out):
        seen.append((cfg["engine"], cfg["cohort-step"], cfg["num-clients"], cfg["fraction-fit"]))
        return [{"seconds": 1.0, "client_peak_rss_mb": 100.0}], 2.0

    monkeypatch.setattr(bench, "flower_round_seconds", fake_rounds)
    assert bench.main(["--scale", "cohort-step=vmap", "--rounds", "1"]) == 0
    assert seen == [("cohort", "vmap", 100, 0.1), ("cohort", "vmap", 1000, 0.01)]
    assert "| 1000 clients, 1% a round | fedavg |" in capsys.readouterr().out


def test_the_scale_benchmark_reports_each_nodes_peak_memory(monkeypatch, capsys):
    """On a Ray cluster each round records its nodes' peaks; the table shows each node's largest over the rounds."""

    def fake_rounds(cfg, rounds, out):
        records = [
            {
                "seconds": 1.0,
                "client_peak_rss_mb": 300.0,
                "node_peak_rss_mb": {"aaaaaaaaaa": 300.0, "bbbbbbbbbb": 250.0},
            },
            {
                "seconds": 1.0,
                "client_peak_rss_mb": 320.0,
                "node_peak_rss_mb": {"aaaaaaaaaa": 280.0, "bbbbbbbbbb": 320.0},
            },
        ]
        return records, 2.0

    monkeypatch.setattr(bench, "flower_round_seconds", fake_rounds)
    assert bench.main(["--scale", "--rounds", "2"]) == 0
    assert "| 320 | aaaaaaaa: 300, bbbbbbbb: 320 |" in capsys.readouterr().out


def test_the_startup_profile_splits_a_run_at_its_milestones():
    from fedbr_flwr.bench.startup import SHUTDOWN, phases

    lines = [
        (2.0, "fedbr-run: fedavg on mnist5k, 10 clients, 20 rounds -> /x"),
        (6.0, "Using SuperLink: local (127.0.0.1:1)"),
        (7.5, "INFO :      Starting Flower Simulation"),
        (12.0, "INFO :      Starting Flower ServerApp, config: num_rounds=20"),
        (20.0, "INFO :      [fedbr] 10 clients found; writing run files to /x"),
        (20.5, "INFO :      [fedbr] round 1/20 | loss 2.0"),
        (30.0, "INFO :      [fedbr] round 20/20 | loss 1.0"),
        (30.6, "INFO :      [fedbr] run files in /x"),
    ]
    got = phases(lines, total=32.0)
    assert list(got.values()) == pytest.approx([2.0, 4.0, 1.5, 4.5, 8.0, 10.0, 0.6, 1.4])
    assert got[SHUTDOWN] == pytest.approx(1.4)


def test_the_startup_profile_reads_the_simulation_process_and_the_bare_loop_alike():
    """Without a SuperLink its phase is absent (not zero); the bare loop's lines end the same phases."""
    from fedbr_flwr.bench.startup import SHUTDOWN, phases, ratios_line

    simulation = [
        (2.0, "fedbr-run: fedavg on mnist5k, 10 clients, 20 rounds -> /x"),
        (2.5, "fedbr simulation: run 123 started"),
        (5.0, "INFO :      Starting Flower ServerApp, config: num_rounds=20"),
        (9.0, "INFO :      [fedbr] 10 clients found; writing run files to /x"),
        (19.0, "INFO :      [fedbr] round 20/20 | loss 1.0"),
        (19.5, "INFO :      [fedbr] run files in /x"),
    ]
    got = phases(simulation, total=20.0)
    assert "SuperLink up, `flwr run` connected" not in got
    assert list(got.values()) == pytest.approx([2.0, 0.5, 2.5, 4.0, 10.0, 0.5, 0.5])
    bare = [
        (1.5, "bare loop: fedavg on mnist5k, 10 clients, 20 rounds"),
        (2.5, "[bare] 10 clients built"),
        (3.0, "[bare] round 1/20 | 0.50 s"),
        (12.5, "[bare] round 20/20 | 0.50 s"),
        (13.0, "[bare] evaluated : mean local-test acc 11.00%"),
    ]
    got = phases(bare, total=14.0)
    assert got["command: imports, config, partition"] == 1.5 and got["rounds"] == 10.0 and got[SHUTDOWN] == 1.0
    medians = {
        "engine=clients": {"whole process": 20.0, "per round, steady": 0.6},
        "bare loop": {"whole process": 14.0, "per round, steady": 0.5},
    }
    assert "engine=clients: 1.43x whole, 1.20x per round" in ratios_line(medians, list(medians))


def test_a_sweeps_fixed_seconds_are_read_per_run():
    from fedbr_flwr.bench.startup import sweep_fixed_seconds

    lines = [
        (1.0, "fedbr-sweep: [1/2] workload seed 0: fedavg -> /x/seed0"),
        (8.5, "[fedbr] 10 clients found; writing run files to /x/seed0"),
        (9.0, "[fedbr] round 1/3 | loss 2.0 | 0.5 s/round"),
        (10.0, "[fedbr] round 3/3 | loss 1.0 | 0.5 s/round"),
        (12.0, "fedbr-sweep: [1/2] workload seed 0: ok"),
        (12.5, "fedbr-sweep: [2/2] workload seed 1: fedavg -> /x/seed1"),
        (13.0, "[fedbr] 10 clients found; writing run files to /x/seed1"),
        (14.0, "[fedbr] round 1/3 | loss 2.0 | 0.5 s/round"),
        (15.0, "[fedbr] round 3/3 | loss 1.0 | 0.5 s/round"),
        (15.25, "fedbr-sweep: [2/2] workload seed 1: failed: no final evaluation"),
    ]
    assert sweep_fixed_seconds(lines) == [
        {"start-up": 7.5, "shut-down": 2.0, "fixed": 9.5},  # the rounds start once the clients are found
        {"start-up": 0.5, "shut-down": 0.25, "fixed": 0.75},
    ]


def test_the_startup_benchmark_says_how_busy_the_machine_was():
    """Other processes' share of the cores during a run: the machine's busy CPU seconds less the measured
    process tree's, over the run's seconds times the cores. Over 10%, the table warns that its ratios close up."""
    import subprocess
    import sys

    from fedbr_flwr.bench import startup

    assert startup.others_share(busy=5.0, ours=3.0, wall=10.0, cores=2) == pytest.approx(0.1)
    assert startup.others_share(busy=2.0, ours=3.0, wall=10.0, cores=2) == 0.0  # clock ticks round: never below 0
    quiet = startup.quiet_line([0.01, 0.04], 0.28)
    assert "bare loop 0.280 s a round" in quiet and "at most 4% of the cores" in quiet and "warning" not in quiet
    assert "warning: the machine was not quiet" in startup.quiet_line([0.01, 0.3], 0.28)
    busy, ours = startup.busy_cpu_seconds(), startup.children_cpu_seconds()
    if busy is None:
        pytest.skip("no /proc/stat here")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    child = startup.children_cpu_seconds() - ours
    assert child >= 0.45 and startup.busy_cpu_seconds() - busy >= child - 0.05  # the machine counted the child too


def test_the_round_profile_sorts_each_sample_of_the_simulation_process_into_its_part():
    from fedbr_flwr.bench import startup

    sim = 'process 1:"fedbr-run";process 2:"python -m fedbr_flwr.launch.simulation";thread (3): T'
    lines = [
        f"{sim};worker (flwr/server/superlink/fleet/vce/vce_api.py:132);"
        "process_message (fedbr_flwr/app/inprocess.py:99);"
        "ClientAlgorithm.fit (fedbr_flwr/core/algorithm.py:1);run_local_steps (fedbr_flwr/core/algorithm.py:2) 30",
        f"{sim};worker (flwr/server/superlink/fleet/vce/vce_api.py:132);"
        "process_message (fedbr_flwr/app/inprocess.py:99);"
        "deepcopy (copy.py:1) 4",
        f"{sim};worker (flwr/server/superlink/fleet/vce/vce_api.py:122);get (queue.py:180) 6",
        f"{sim};fit_round (flwr/server/server.py:1);aggregate_fit (fedbr_flwr/app/strategy.py:96) 2",
        f"{sim};fit_clients (flwr/x.py:1);send_and_receive (fedbr_flwr/launch/simulation.py:240) 50",
        f"{sim};_update_client_manager (flwr/x.py:1);wait (threading.py:1) 7",
        # the command: not counted
        'process 1:"fedbr-run";thread (9): MainThread;main (fedbr_flwr/commands/cli.py:1) 99',
        "a line py-spy would not write",
    ]
    parts = startup.profile_parts(lines)
    assert parts == {
        "clients: local training": 30,
        "clients: the message's arrays, state and context (decode, encode, copies)": 4,
        "clients: waiting for a message (idle)": 6,
        "server: aggregate_fit (update checks, aggregation, the round's record)": 2,
        "server: waiting for the replies (idle)": 50,
        startup.OTHER_PART: 7,
    }
    table = startup.profile_table(parts, rounds=2, rate=10)
    assert "| clients: local training | 3.00 | 1500.0 |" in table and "| clients: evaluation | 0.00 | 0.0 |" in table


def test_the_round_profile_without_py_spy_stops_with_one_line(monkeypatch, capsys):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bench.main(["--round-profile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs py-spy" in err


@pytest.mark.parametrize("variant, warned", [("engine=cohort, backend=ray", False), ("engine=cohort", True)])
def test_the_cpu_of_ray_or_a_superlink_is_not_taken_for_a_busy_machine(monkeypatch, capsys, variant, warned):
    """Ray's and the SuperLink's processes are not the command's waited-for children, so their CPU time looks like
    other processes'; the quiet line reads only the other variants' runs."""
    from fedbr_flwr.bench import startup

    clock = iter([0.0, 8.0])  # the machine was busy 8 CPU-s during a 4 s run on 2 cores, none of it a child's
    monkeypatch.setattr(startup, "busy_cpu_seconds", lambda: next(clock))
    monkeypatch.setattr(startup, "children_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(startup, "timed_lines", lambda command: ([], 4.0, 0))
    monkeypatch.setattr(startup, "steady_round_seconds", lambda out: 0.4)
    monkeypatch.setattr(startup.os, "cpu_count", lambda: 2)
    assert startup.startup_main([], 1, [variant], None) == 0
    assert ("warning: the machine was not quiet" in capsys.readouterr().out) == warned


def test_the_peak_a_suite_is_compared_with_is_that_of_the_arithmetic_it_ran():
    """An fp32 suite with tf32=true (the default) runs its convolutions on TF32 tensor cores, but was set against
    the 67 TFLOP/s of fp32 without them: "47% of peak" was 6% of the TF32 one."""
    h100 = "NVIDIA H100 80GB HBM3"
    assert [bench.arithmetic({"precision": "fp32", "tf32": t}) for t in (True, False)] == ["tf32", "fp32"]
    assert bench.arithmetic({"precision": "bf16", "tf32": True}) == "bf16"
    assert [bench.peak_tflops(h100, a) for a in ("tf32", "fp32", "bf16")] == [494.7, 67.0, 989.0]
    assert bench.peak_tflops("cpu", "tf32") is None


def test_a_pcie_or_nvl_card_is_set_against_its_own_peak_not_the_sxm_one():
    """torch names an H100 PCIe "NVIDIA H100 PCIe": matched on "H100" alone, it was set against the SXM part's
    494.7 TFLOP/s, which it cannot reach, and its share of peak read low."""
    assert bench.peak_tflops("NVIDIA H100 PCIe", "tf32") == 378.0
    assert bench.peak_tflops("NVIDIA H100 NVL", "bf16") == 835.5
    assert bench.peak_tflops("NVIDIA H200 NVL", "tf32") == 417.5
    assert bench.peak_tflops("NVIDIA H200", "tf32") == 494.7


def test_the_flop_counter_counts_attention_and_the_fused_transformer_layer_by_hand():
    """torch counts no FLOPs for the CPU's attention kernel and its backward, nor for the fused forward of a
    transformer layer (eval mode, no gradients) or of a multi-head attention: the bench's counter adds them.
    A tiny CCT: every matrix product by hand, with 2 FLOPs a multiply-add."""
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from fedbr_flwr.bench.flops import FitFlopCounter
    from fedbr_flwr.core.model import CCTFeatures

    b, c, s, d, layers, heads, ratio = 2, 3, 8, 16, 2, 2, 2
    torch.manual_seed(0)
    model = CCTFeatures(c, s, d, layers, heads, ratio)
    x = torch.randn(b, c, s, s)
    t = ((s + 1) // 2) ** 2  # tokens after the stride-2 pool
    conv = 2 * b * s * s * d * c * 9
    linear = layers * 2 * b * t * (3 * d * d + d * d + 2 * d * d * ratio) + 2 * b * t * d  # + the pooling logit
    attention = layers * 2 * (2 * b * t * t * d)  # q k^T, then its product with v, over all heads
    # backward: the conv's weight gradient only (its input is data); a linear layer's input and weight gradients;
    # attention: the scores again and four gradients (torch's count for its GPU kernels)
    train = 2 * conv + 3 * linear + attention + attention * 5 // 2
    with FitFlopCounter() as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() == train
    with FlopCounterMode(display=False) as plain:
        model(x).sum().backward()
    assert plain.get_total_flops() < train  # what torch's counter alone misses

    model.eval()
    with torch.no_grad(), FitFlopCounter() as counter:  # nn.TransformerEncoderLayer's fast path
        model(x)
    assert counter.get_total_flops() == conv + linear + attention

    attend = nn.MultiheadAttention(d, heads, batch_first=True).eval()
    tokens = torch.randn(b, t, d)
    with torch.no_grad(), FitFlopCounter() as counter:  # nn.MultiheadAttention's fast path
        attend(tokens, tokens, tokens)
    assert counter.get_total_flops() == 2 * b * t * 4 * d * d + 4 * b * t * t * d


def test_a_cct_fits_count_matches_the_hand_count():
    """One image, one step of CCT-7/3x1 on 32x32 inputs: the forward (the tokenizer's conv, in each of 7 layers
    the q, k, v, output and two feed-forward projections and the attention, the pooling logit, the classifier)
    and its backward. FedNTD adds one forward of the frozen global model, which runs the fused layer."""
    from fedbr_flwr.data.catalog import INFO

    def flops(strategy):
        settings = {"strategy": strategy, "dataset": "synthetic", "model": "cct", "num-clients": 2}
        return bench.fit_flops(config_from_settings({**settings, "local-steps": 1, "batch-size": 1, "device": "cpu"}))

    info = INFO["synthetic"]
    d, t, layers, hidden = 256, (info.image_size // 2) ** 2, 7, 512
    conv = 2 * info.image_size**2 * d * info.in_channels * 9
    linear = layers * 2 * t * (4 * d * d + 2 * d * hidden) + 2 * t * d + 2 * d * info.num_classes
    attention = layers * 4 * t * t * d
    fedavg = flops("fedavg")
    assert fedavg == 2 * conv + 3 * linear + attention * 7 // 2
    assert flops("fedntd") - fedavg == conv + linear + attention
