"""elasticctl without a cluster: its help and the user guide agree with the code (exit codes, the
default endpoint), a rank's log as it shows it, the report's line. Nothing runs."""

from __future__ import annotations

import io
import os
import re

from mselastic.ctl import main as ctl
from tests.harness import REPO


def _codes(text: str) -> set[int]:
    """The exit codes a text lists ("Exit codes: 0 done; 1 ...; 2 ...", up to its paragraph's end)."""
    listing = text.split("Exit codes:", 1)[1].split("\n\n", 1)[0].split("Errors are", 1)[0]
    return {int(n) for n in re.findall(r"(?:^|;)\s*(\d)\s", listing)}


def test_elasticctl_help_and_the_user_guide_list_every_exit_code() -> None:
    codes = {ctl.EXIT_OK, ctl.EXIT_REFUSED, ctl.EXIT_USAGE, ctl.EXIT_UNREACHABLE, ctl.EXIT_NOT_ELASTICD,
             ctl.EXIT_ETCD_DOWN}
    with open(os.path.join(REPO, "docs", "user-guide.md")) as f:
        readme = f.read()
    assert _codes(ctl.__doc__ or "") == codes
    assert _codes(readme) == codes


def test_the_default_endpoint_is_said_the_same_way_everywhere() -> None:
    endpoints = next(a for a in ctl.build_parser()._actions if "--endpoints" in a.option_strings)
    assert "local elasticd's socket" in (endpoints.help or "") and "127.0.0.1:7070" in (endpoints.help or "")
    assert "the local elasticd's socket" in (ctl.__doc__ or "") and "else 127.0.0.1:7070" in (ctl.__doc__ or "")


def test_a_ranks_log_leaves_out_mindspores_chatter_unless_asked() -> None:
    """As `elasticctl logs` shows it: the rank's own lines and MindSpore's errors, whole lines even
    when a line arrives in two chunks; with --all, everything as it came."""
    log = (b"[WARNING] ME(7756:140084068449152,MainProcess):2026-12-02-19:56:22.100.000 [mindspore/x.py:1] "
           b"Topology build timed out., retry(1/360)\n"
           b"[INFO] DISTRIBUTED(7756,7f,python):2026-12-02-19:56:22 [cluster.cc:9] joined\n"
           b"step 10 loss 0.51\n"
           b"[ERROR] ME(7756:140084068449152,MainProcess):2026-12-02 [x.py:2] a real error\n"
           b"[WARNING] the script's own warning\n"
           b"step 11 loss 0.50")
    lines = ctl.LogLines()
    shown = lines.feed(log[:150]) + lines.feed(log[150:]) + lines.end()
    assert shown == (b"step 10 loss 0.51\n[ERROR] ME(7756:140084068449152,MainProcess):2026-12-02 [x.py:2] a real "
                     b"error\n[WARNING] the script's own warning\nstep 11 loss 0.50")
    everything = ctl.LogLines(everything=True)
    assert everything.feed(log[:150]) + everything.feed(log[150:]) + everything.end() == log


def test_the_report_draws_the_run_to_where_it_ended() -> None:
    """Progress events come every progress_interval_s: the last one may be at step 283 of a job
    that reached 300; the line goes on to the status's step at the last event's time."""
    from mselastic.ctl.report import steps_over_time
    from mselastic.v1 import elastic_pb2 as pb

    progress = [pb.Event(at=10.0, kind="progress", generation=1, step=100),
                pb.Event(at=20.0, kind="progress", generation=2, step=283)]
    done = pb.JobStatus(generation=2, step=300)
    assert steps_over_time(done, progress, end=25.0) == {1: [(10.0, 100)], 2: [(20.0, 283), (25.0, 300)]}
    assert steps_over_time(pb.JobStatus(generation=2, step=283), progress, end=25.0)[2] == [(20.0, 283)]


def test_without_a_socket_it_says_which_elasticd_it_asks(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """No socket this user may open: the TCP fallback is said on stderr (another user's elasticd
    may answer there), and an endpoint given is used without a word."""
    monkeypatch.setattr(ctl, "default_sockets", lambda: ["/nonexistent/elasticd.sock"])
    monkeypatch.delenv("ELASTICCTL_ENDPOINTS", raising=False)
    monkeypatch.delenv("ELASTICCTL_ENDPOINT", raising=False)
    monkeypatch.setattr(ctl, "COMMANDS", {**ctl.COMMANDS, "status": lambda c, a, out: 0})
    assert ctl.run(["status"]) == 0
    err = capsys.readouterr().err
    assert "no elasticd socket this user may open (/nonexistent/elasticd.sock): asking 127.0.0.1:7070 over TCP, " \
           "where one may only look" in err, err
    assert ctl.run(["--endpoint", "127.0.0.1:7070", "status"]) == 0
    assert capsys.readouterr().err == ""


def test_watch_until_knows_the_states() -> None:
    assert ctl.WATCHABLE == ("PENDING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "STOPPED")
    assert ctl.main(["--endpoint", "127.0.0.1:1", "watch", "j", "--until", "trainin"]) == ctl.EXIT_USAGE


def test_a_jobs_text_never_drives_the_terminal() -> None:
    """A rank's note or log line with escape sequences (clear the screen, a carriage return that
    hides what came before) is shown, not acted on: in tables, and in logs written to a terminal."""
    from mselastic.ctl import render

    assert render.printable("ok\x1b[2J\rfake\tx\n") == "ok\\x1b[2J\\x0dfake\tx\n"
    lines = ctl.LogLines(terminal=True)
    assert lines.feed(b"step 1\x1b]0;owned\x07\n") == b"step 1\\x1b]0;owned\\x07\n"
    assert ctl.LogLines().feed(b"raw \x1b[0m\n") == b"raw \x1b[0m\n"  # into a file or a pipe: the bytes as written
    everything = ctl.LogLines(everything=True, terminal=True)
    assert everything.feed(b"[INFO] \x1b[2J") == b"[INFO] \\x1b[2J"
    assert lines.feed(b"tail \x1b[2J") == b"" and lines.end() == b"tail \\x1b[2J"  # the last, unfinished line too
    out = io.StringIO()
    render.emit(out, "table", {}, lambda: "note: \x1b[31mred")
    assert out.getvalue() == "note: \\x1b[31mred\n"
