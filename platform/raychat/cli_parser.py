"""The ArgumentParser of every `raychat` command line (OneLineParser: one-line errors, whole flag names only, "did
you mean" hints), in a module of its own so that raychat.cli builds `raychat --help` with it importing nothing
else, and raychat.commands checks a submitted stage's words with the same rules (StageArgs)."""

from __future__ import annotations

import argparse
import difflib


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the whole usage block first), which takes
    whole flag names only (allow_abbrev=False: `--num-it 3` is an unrecognized argument, not --num-iterations,
    so a flag added later never changes what an abbreviated command line meant), and which refuses a blank
    value for a plain text argument whose default is not blank (`--address ""`, `jobs stop ""`: otherwise read
    as "not given", or passed on as ''). The subcommands' parsers are of the same class (add_subparsers'
    default); the config flags check their own values (raychat.config.flags)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unrecognized argument is refused by the (sub)command's parser it was given to, so
        the line names `raychat pretrain` and its --help, whose flags it lists, not `raychat`'s; the line ends
        with the flags its unknown ones are close to (did_you_mean), or, for a flag of that (sub)command given
        before its name (`raychat jobs --follow logs ID`), that it goes after the name."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen(namespace)
            flags = [s for a in chosen._actions for s in a.option_strings]
            typed = [  # flags as typed: not a value such as -1 that follows one
                word.partition("=")[0]
                for word in extras
                if word.startswith("-") and not chosen._negative_number_matcher.match(word)
            ]
            close = [(word, did_you_mean(word, flags)) for word in typed]
            after = chosen.prog.rpartition(" ")[2]  # the word a flag of `chosen` given before it goes after
            close = [
                (word, f"{flag} after {after}" if flag == word else flag) for word, flag in close if flag
            ]
            hint = ", ".join(flag if len(typed) == 1 else f"{flag} for {word}" for word, flag in close)
            chosen.error(
                f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {hint}?)" if hint else "")
            )
        return namespace

    def _check_value(self, action, value):
        """argparse's check of a value against `action.choices` (a subcommand's name, a --flag's allowed
        values), whose refusal ends with the choice `value` is close to (did_you_mean)."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            close = did_you_mean(value, action.choices) if isinstance(value, str) else None
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{e.message} (did you mean {close}?)") from None

    def _chosen(self, namespace) -> argparse.ArgumentParser:
        """The innermost subcommand parser `namespace` was parsed by (self when there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, OneLineParser):
                    return chosen._chosen(namespace)
        return self

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if action.type is not None or action.nargs == argparse.REMAINDER or action.default == "":
                continue
            value = getattr(namespace, action.dest, None)
            if any(
                isinstance(v, str) and not v.strip() for v in (value if isinstance(value, list) else [value])
            ):
                # named as argparse's own errors name it: the flag, else the metavar that usage shows
                self.error(str(argparse.ArgumentError(action, "must not be blank")))
        return namespace, extras


def did_you_mean(word: str, choices) -> str | None:
    """The one of `choices` (strings; others are skipped) closest to `word`, a mistyped command, flag or value,
    or None when none is close: leading dashes are ignored on both sides (every flag starts with "--"), and a
    choice must reach difflib's similarity ratio 0.75 (`pretrian` -> pretrain, `--checkpiont` -> --checkpoint,
    `--checkp` -> --checkpoint; one wrong letter of a 4-letter word is 0.75, while another command's flag that is
    no misspelling, `--port` for pretrain, `--backend` for chat, comes out below)."""
    names = {choice.lstrip("-"): choice for choice in choices if isinstance(choice, str)}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.75)
    return names[close[0]] if close else None
