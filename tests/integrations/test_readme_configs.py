"""The SGLang and LMCache configurations README.md shows, taken as written.

Users copy the README's examples, so these tests read them from README.md:
SGLang's ``--hicache-storage-backend-extra-config`` JSON (which SGLang
``json.loads`` into ``HiCacheStorageConfig.extra_config``) goes to SGLang's
``StorageBackendFactory``, LMCache's YAML is loaded by
``LMCacheEngineConfig.from_file`` and its plugin loader.  Only what names
this machine changes: the device (a store file) and, for LMCache, the chunk
size and CPU cache size of the test's small model.  Then pages and chunks
round-trip byte for byte.  (The vLLM command: tests/integrations_vllm/test_vllm_config.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
import yaml
from lmcache.v1.config import LMCacheEngineConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvblock.integrations.lmcache import KVBlockStorageBackend
from kvblock.integrations.sglang import KVBlockHiCacheStorage
from tests.integrations.sglang_pools import HostPool
from tests.integrations.test_lmcache import CHUNK, Engine, obj_bytes
from tests.integrations.test_sglang import keys_for, storage_config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def readme_sglang_extra_config() -> dict:
    found = re.findall(r"--hicache-storage-backend-extra-config '([^']+)'", README)
    assert len(found) == 1, "README.md should show one SGLang extra config"
    return json.loads(found[0])


def readme_lmcache_yaml() -> dict:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", README, re.DOTALL)
              if "storage_plugins" in b]
    assert len(blocks) == 1, "README.md should show one LMCache YAML config"
    return yaml.safe_load(blocks[0])


def test_readmes_sglang_extra_config_loads_the_backend(file_target, backends):
    extra = readme_sglang_extra_config()
    extra["devices"] = [file_target()]
    # exactly the README's keys (SGLang json.loads the flag into extra_config)
    config = dataclasses.replace(storage_config([]), extra_config=extra)
    pool = HostPool()
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backends.append(backend)
    assert isinstance(backend, KVBlockHiCacheStorage)
    backend.register_mem_pool_host(pool)      # as HiCacheController attaches it
    backend.on_host_pools_registered()
    keys = keys_for("r", 3)
    pages = [2, 5, 6]
    want = [pool.page_bytes(p) for p in pages]
    assert backend.batch_set_v1(keys, pool.token_indices(pages)) == [True] * 3
    pool.randomize(1)
    assert backend.batch_get_v1(keys, pool.token_indices([9, 0, 4])) == [True] * 3
    for p, page in zip((9, 0, 4), want):
        assert torch.equal(pool.page_bytes(p), page)


def test_readmes_lmcache_yaml_loads_the_plugin(file_target, engines, tmp_path):
    conf = readme_lmcache_yaml()
    assert conf["storage_plugins"] == ["kvblock"]
    conf["extra_config"]["kvblock.devices"] = [file_target()]
    conf["chunk_size"], conf["max_local_cpu_size"] = CHUNK, 0.05   # the test's small model
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(conf))
    e = Engine(None, config=LMCacheEngineConfig.from_file(str(path)))
    engines.append(e)
    assert isinstance(e.plugin, KVBlockStorageBackend)
    keys = [e.key(h) for h in (1, 2)]
    want = e.put(keys, [e.chunk() for _ in keys])
    objs = e.retrieve(keys)
    assert [obj_bytes(o) for o in objs] == want
    for o in objs:
        o.ref_count_down()
    assert e.plugin.store.stats()["blocks"] == 2


def _readme_other_keys(start: str, end: str) -> set[str]:
    """The `keys` of the "Other keys: ..." sentence between ``start`` and ``end``."""
    para = README[README.index(start):README.index(end)]
    other = re.search(r"Other (?:keys|settings): (.*?)\.\s", para, re.DOTALL)
    assert other, f"README's paragraph from {start!r} lists no other keys"
    return set(re.findall(r"`(?:kvblock\.)?(\w+)`", other.group(1)))


def test_readme_names_every_key_the_sglang_backend_takes():
    """A key the backend takes that README leaves out is one a user never
    learns of (the vLLM tier's: test_vllm_config.py)."""
    from kvblock.integrations.sglang import _OWN_KEYS

    named = set(readme_sglang_extra_config()) | _readme_other_keys("**SGLang 0.5.23**",
                                                                   "**LMCache 0.5.x**")
    assert _OWN_KEYS <= named, f"README leaves out {sorted(_OWN_KEYS - named)}"


def test_readme_names_every_setting_the_lmcache_plugin_takes():
    from kvblock.integrations.lmcache import _OPTIONS

    shown = {k.removeprefix("kvblock.") for k in readme_lmcache_yaml()["extra_config"]
             if k.startswith("kvblock.")}
    block = README[README.index("storage_plugins: [\"kvblock\"]"):]
    shown |= set(re.findall(r"kvblock\.(\w+):", block[:block.index("```")]))   # commented
    named = shown | _readme_other_keys("**LMCache 0.5.x**", "### Against the engines")
    assert _OPTIONS <= named, f"README leaves out {sorted(_OPTIONS - named)}"


def test_readmes_quoted_sglang_default_run_size_is_the_backends():
    from kvblock.integrations.sglang import DEFAULT_MAX_RUN_BYTES
    from kvblock.units import parse_size

    para = README[README.index("**SGLang 0.5.23**"):README.index("**LMCache 0.5.x**")]
    quoted = re.search(r"`max_run_bytes` \(default (\w+)\)", para)
    assert quoted and parse_size(quoted.group(1)) == DEFAULT_MAX_RUN_BYTES
