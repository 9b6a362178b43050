"""`kvexport generate --speculative ...`: the same greedy answer as without it; bad speculative
settings are exit code 2 naming the setting (runtime/config.py, runtime/draft_model.py)."""


def test_ngram_speculation_answers_as_without_it(invoke, text_build):
    prompt = "one two three one two three one two"
    plain = invoke("generate", text_build, prompt, "--max-tokens", 12)
    spec = invoke("generate", text_build, prompt, "--max-tokens", 12, "--speculative", "ngram",
                  "--num-speculative-tokens", 3)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout


def test_bad_speculative_settings_name_the_setting(invoke, text_build, tmp_path):
    for args, what in ((["--speculative", "ngram", "--num-speculative-tokens", 0], "num_speculative_tokens"),
                       (["--speculative", "draft"], "draft_model"),
                       (["--draft-model", str(text_build)], "draft_model"),
                       (["--speculative", "draft", "--draft-model", str(tmp_path)], "draft_model")):
        r = invoke("generate", text_build, "hi", *args)
        assert r.exit_code == 2, r.output
        assert what in r.stderr and "Traceback" not in r.output
    r = invoke("generate", text_build, "hi", "--speculative", "eagle")
    assert r.exit_code == 2 and "eagle" in r.output
