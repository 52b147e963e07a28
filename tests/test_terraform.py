"""infra/terraform/main.tf: every write grant is made of ``local.writes``, the one list of
what each role writes (the end-to-end runs check the list against every write their
processes make: ``tests/iam.py``, in the chaos run and the join run)."""

from __future__ import annotations

import re

from tests.iam import MAIN_TF, granted, policy_writes, role_of


def test_every_write_grant_is_made_of_the_roles_lists():
    text = MAIN_TF.read_text()
    writes = policy_writes()
    assert set(writes) == {"learner", "syncer", "launcher"}, writes
    # a learner's own keys: its folder, its status, a slot it adds, its unit claims
    mine = [k.replace("LEARNER", "learner-1") for k in writes["learner"]]
    assert granted(mine, "learners/learner-1/checkpoints/x")
    assert not granted(mine, "learners/learner-2/checkpoints/x")
    assert not granted(mine, "globals/f0000/commits/v1.json")
    # one identity per writer of each bucket, its grants made of its role's list
    for bucket in ("us_east", "eu_west"):
        assert (
            f"{bucket}_writers = merge(" in text
            and 'syncer = "syncer", launcher = "launcher"' in text
        )
    s3 = re.findall(r'Action\s+= \["s3:PutObject", "s3:DeleteObject"\]\s+Resource\s+= (.*)', text)
    assert s3 == ['[for r in local.s3_writes[local.us_east_writers[each.key]] : replace(r, "LEARNER", '
                  "each.key)]"], s3  # fmt: skip
    gcs = re.findall(r"expression = (.*)", text)
    assert gcs == ['replace(local.gcs_writes[local.eu_west_writers[each.key]], "LEARNER", '
                   "each.key)"], gcs  # fmt: skip
    assert "s3_writes = { for role, keys in local.writes" in text
    assert "gcs_writes = { for role, keys in local.writes" in text
    assert '"roles/storage.objectCreator"' not in text  # (it cannot overwrite a status)


def test_a_traced_process_is_known_by_its_salt():
    assert role_of("learner-3/2") == ("learner", "learner-3")
    assert role_of("syncer-0/1") == ("syncer", "syncer-0")
    assert role_of("") == ("launcher", None)
