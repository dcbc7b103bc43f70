"""`infinity doctor`: a subsystem whose checks crash is reported (not raised), and every
command its fix text suggests uses flags `infinity doctor --help` really has."""
import re

from infinity.cli import doctor
from infinity.cli.main import main


def test_crashing_subsystem_is_reported_with_a_real_flag(monkeypatch, capsys):
    import infinity.optim as iopt

    def boom():
        raise RuntimeError("simulated")

    monkeypatch.setattr(iopt, "doctor_checks", boom)
    checks = doctor._subsystem_checks("infinity.optim")
    assert len(checks) == 1 and checks[0]["ok"] is False
    assert "RuntimeError: simulated" in checks[0]["detail"]
    fix = checks[0]["fix"]
    flags = re.findall(r"infinity doctor ((?:-{1,2}[a-z-]+ ?)+)", fix)
    assert flags, fix
    try:
        main(["doctor", "--help"])
    except SystemExit:
        pass
    helptext = capsys.readouterr().out
    for f in flags[0].split():
        assert re.search(rf"(^|\s){re.escape(f)}\b", helptext), (f, helptext)
