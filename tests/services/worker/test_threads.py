from services.worker.threads import SPIN_ROUNDS, set_openmp_wait


def test_the_engine_threads_spin_a_while_by_default() -> None:
    environ: dict[str, str] = {}
    set_openmp_wait(environ)
    assert environ == {"GOMP_SPINCOUNT": SPIN_ROUNDS}


def test_a_wait_policy_from_the_environment_wins() -> None:
    environ = {"OMP_WAIT_POLICY": "PASSIVE"}
    set_openmp_wait(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}  # a spin count would override it


def test_a_spin_count_from_the_environment_wins() -> None:
    environ = {"GOMP_SPINCOUNT": "0"}
    set_openmp_wait(environ)
    assert environ == {"GOMP_SPINCOUNT": "0"}
