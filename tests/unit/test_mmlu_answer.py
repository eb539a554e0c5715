"""MMLU records (raychat.tasks.loaders.mmlu_error): `answer` is the int index of a choice, as cais/mmlu stores
it; 1.9, True or "2" were taken as an index (int() of them: 1.9 -> B) without a word."""

from raychat.tasks.loaders import mmlu_error


def record(answer) -> dict:
    return {"question": "2 + 2?", "choices": ["3", "4", "5", "6"], "answer": answer}


def test_an_answer_that_is_not_an_int_index_is_an_error_naming_it():
    assert [mmlu_error(record(a)) for a in (1.9, True, "2", None)] == [
        "answer 1.9 is not the index of one of the 4 choices (0..3)",
        "answer True is not the index of one of the 4 choices (0..3)",
        "answer '2' is not the index of one of the 4 choices (0..3)",
        "answer None is not the index of one of the 4 choices (0..3)",
    ]
    assert mmlu_error(record(4)) == "answer 4 is not the index of one of the 4 choices (0..3)"


def test_an_int_index_is_accepted():
    assert [mmlu_error(record(a)) for a in (0, 1, 3)] == [None, None, None]
    assert mmlu_error({"train": record(1)}) is None  # auxiliary_train's nesting
