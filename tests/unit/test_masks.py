import torch

from raychat.masks import (
    document_causal_mask,
    make_batch,
    position_ids_from_segments,
    segment_ids_from_bos,
    shift_labels,
)


def test_one_label_shift_follows_the_predicted_token():
    ids = torch.tensor([[10, 11, 12, 20, 21]])
    supervised = torch.tensor([[0, 0, 1, 1, 1]])
    segments = torch.tensor([[0, 0, 0, 1, 1]])
    inputs, labels, loss_mask, seg = shift_labels(ids, supervised, segments)
    assert inputs.tolist() == [[10, 11, 12, 20]]
    assert labels.tolist() == [[11, 12, 20, 21]]
    assert loss_mask.tolist() == [[False, True, False, True]]
    assert seg.tolist() == [[0, 0, 0, 1]]


def test_positions_restart_per_document():
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    assert position_ids_from_segments(seg).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def test_document_mask_is_causal_and_within_document():
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    mask = document_causal_mask(seg)[0, 0]
    for i in range(8):
        for j in range(8):
            assert bool(mask[i, j]) == (j <= i and seg[0, i] == seg[0, j])


def test_segments_from_bos_and_make_batch_for_a_pretraining_row():
    bos = 1
    row = torch.tensor([[1, 5, 6, 1, 7, 8, 9]])  # two documents, T+1 = 7
    assert segment_ids_from_bos(row, bos).tolist() == [[1, 1, 1, 2, 2, 2, 2]]
    b = make_batch(row, bos, document_masking=True)
    assert b["input_ids"].tolist() == [[1, 5, 6, 1, 7, 8]]
    assert b["labels"].tolist() == [[5, 6, 1, 7, 8, 9]]
    # the BOS opening document 2 is never a target of document 1
    assert b["loss_mask"].tolist() == [[True, True, False, True, True, True]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    plain = make_batch(row, bos, document_masking=False)
    assert plain["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert "segment_ids" not in plain
    assert plain["loss_mask"].tolist() == b["loss_mask"].tolist()
