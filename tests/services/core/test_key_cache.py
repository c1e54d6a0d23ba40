from services.core.auth import Principal
from services.core.key_cache import KeyCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def principal(key_id: str = "k1", secret_hash: str = "h1") -> Principal:
    return Principal(tenant_id="t1", key_id=key_id, secret_hash=secret_hash)


def test_a_key_is_kept_for_its_seconds_and_only_for_the_secret_that_matched() -> None:
    clock = Clock()
    cache = KeyCache(seconds=5.0, clock=clock)
    cache.put(principal(), valid_for=None)
    assert cache.get("k1", "h1") == principal()
    assert cache.get("k1", "another secret's hash") is None
    assert cache.get("k2", "h1") is None
    clock.now += 4.9
    assert cache.get("k1", "h1") == principal()
    clock.now += 0.2
    assert cache.get("k1", "h1") is None
    assert len(cache) == 0


def test_never_past_the_secrets_own_expiry() -> None:
    clock = Clock()
    cache = KeyCache(seconds=5.0, clock=clock)
    cache.put(principal(), valid_for=0.5)
    clock.now += 0.6
    assert cache.get("k1", "h1") is None
    cache.put(principal(), valid_for=-1.0)  # expired already: not kept
    assert len(cache) == 0


def test_forget_drops_every_secret_of_a_key_and_a_full_cache_drops_the_oldest() -> None:
    cache = KeyCache(seconds=5.0, max_entries=2, clock=Clock())
    cache.put(principal("k1", "old"), valid_for=None)
    cache.put(principal("k1", "new"), valid_for=None)
    cache.forget("k1")
    assert cache.get("k1", "old") is None and cache.get("k1", "new") is None
    for key_id in ("a", "b"):
        cache.put(principal(key_id), valid_for=None)
    assert cache.get("a", "h1") is not None  # now the most recently used
    cache.put(principal("c"), valid_for=None)
    assert cache.get("b", "h1") is None
    assert cache.get("a", "h1") is not None and cache.get("c", "h1") is not None


def test_no_seconds_keeps_nothing() -> None:
    cache = KeyCache(seconds=0.0, clock=Clock())
    cache.put(principal(), valid_for=None)
    assert cache.get("k1", "h1") is None
