"""bench.step_profile's phase timer: wraps methods of instances, classes and modules, counts calls, and puts every
original back (a profile must not leave the engine instrumented)."""

import types

import pytest

from bench.step_profile import PhaseTimer, setting_k


class Thing:
    def work(self, x):
        return x + 1


def test_phase_timer_times_and_restores_instance_class_and_module_attributes():
    thing, module = Thing(), types.ModuleType("m")
    module.helper = lambda x: x * 2
    original_helper, original_work = module.helper, Thing.work
    timer = PhaseTimer()
    timer.wrap(thing, "work", "instance")
    timer.wrap(Thing, "work", "class")
    timer.wrap(module, "helper", "module")
    assert thing.work(1) == 2 and Thing().work(2) == 3 and module.helper(3) == 6
    assert timer.calls == {"instance": 1, "class": 1, "module": 1}  # the instance kept the method it wrapped
    assert all(s >= 0 for s in timer.seconds.values())
    timer.restore()
    assert "work" not in vars(thing) and Thing.work is original_work and module.helper is original_helper


def test_settings_name_plain_auto_or_a_fixed_k():
    assert (setting_k("plain"), setting_k("default"), setting_k("k=3")) == (0, None, 3)
    with pytest.raises(SystemExit):
        setting_k("k=two")
