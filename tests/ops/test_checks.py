"""alignlit.checks.validate_optimizer_args: every bad setting is named by its field."""

import math

import pytest

from alignlit.checks import MAX_LR, internals_changed, pinned_range, validate_optimizer_args


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 1e38}, r"optim\.lr must be a finite number in \(0, 10\], got 1e\+38"),
        ({"lr": 0.0}, r"optim\.lr must be .*got 0\.0"),
        ({"lr": -1e-4}, r"optim\.lr must be"),
        ({"lr": math.nan}, r"optim\.lr must be .*got nan"),
        ({"lr": math.inf}, r"optim\.lr must be .*got inf"),
        ({"lr": True}, r"optim\.lr must be"),
        ({"lr": 1e-4, "weight_decay": -0.1}, r"optim\.weight_decay must be a finite number >= 0"),
        ({"lr": 1e-4, "weight_decay": math.inf}, r"optim\.weight_decay"),
        (
            {"lr": 1e-4, "betas": (0.9, 1.0)},
            r"optim\.betas must be two numbers in \[0, 1\), got \(0\.9, 1\.0\)",
        ),
        ({"lr": 1e-4, "betas": (0.9,)}, r"optim\.betas"),
        ({"lr": 1e-4, "eps": 0.0}, r"optim\.eps must be a finite number > 0"),
        ({"lr": 1e-4, "warmup_steps": -1}, r"optim\.warmup_steps must be an integer >= 0"),
        ({"lr": 1e-4, "min_lr_ratio": 1.5}, r"optim\.min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_settings_name_their_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_optimizer_args(**kwargs)


def test_good_settings_and_prefix():
    validate_optimizer_args(3e-4, 0.01, (0.9, 0.95), eps=1e-8, warmup_steps=0, min_lr_ratio=0.0)
    validate_optimizer_args(MAX_LR)
    with pytest.raises(ValueError, match=r"critic_optim\.lr"):
        validate_optimizer_args(20.0, prefix="critic_optim.")


def test_internals_changed_names_the_version_the_module_and_the_pinned_range():
    class Changed(RuntimeError):
        pass

    error = internals_changed(Changed, "pytest", "Thing.attr", "gone", by="alignlit.x.pytest_internals")
    assert type(error) is Changed
    assert str(error) == (
        f"pytest {pytest.__version__}: Thing.attr moved or changed (gone); alignlit.x.pytest_internals relies on "
        f"it: install the pinned {pinned_range('pytest')}, or update pytest_internals"
    )
    other = internals_changed(Changed, "pytest", "a", "b", by="m", distribution="torch")
    assert f"install the pinned {pinned_range('torch')}, or update m" in str(other)
