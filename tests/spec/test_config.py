import dataclasses

import pytest

from deltaserve.spec.config import SpeculativeConfig, check_model


def test_parse_dict_and_json():
    c = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3})
    assert c == SpeculativeConfig("mtp", 3) and c.prompt_lookup_min is None
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 5})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(c) is c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.method = "mtp"


@pytest.mark.parametrize("value, key", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "mtp"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 1}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 1, "draft_model": "x"}, "draft_model"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ("{not json", "JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_values_are_refused_by_name(value, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.parse(value)


class _Model:
    def __init__(self, mtp):
        self.mtp_num_layers = mtp


def test_check_model_refuses_mtp_without_a_head():
    check_model(SpeculativeConfig("mtp", 2), _Model(1))
    check_model(SpeculativeConfig("ngram", 2), _Model(0))
    check_model(None, _Model(0))
    with pytest.raises(ValueError, match="MTP head"):
        check_model(SpeculativeConfig("mtp", 2), _Model(0))


def test_embedded_model_has_an_mtp_head():
    from pathlib import Path

    import deltaserve
    from deltaserve.config import ModelConfig
    config = ModelConfig.from_hf(Path(deltaserve.__file__).parent / "default_model")
    assert config.mtp_num_layers >= 1
    check_model(SpeculativeConfig("mtp", 3), config)
