"""gflags-style command lines: one parser for the ``caffempi`` command and
every tool, as Caffe's binaries parse theirs with gflags.

A :class:`FlagSet` holds one program's flags (:meth:`FlagSet.define`) and
positional arguments (:meth:`FlagSet.argument`); :meth:`FlagSet.parse`
reads an argument list as gflags does:

* ``-flag=value``, ``--flag=value``, ``-flag value``, ``--flag value``;
  booleans as ``-flag``, ``--flag``, ``--flag=true|false|1|0|yes|no|t|f|y|n``
  and ``--noflag`` (a boolean never takes the next argument as its value);
* flags and positional arguments in any order (gflags moves the arguments
  after the flags); ``--`` ends the flags; ``-`` alone is an argument;
* ``--flagfile=FILE[,FILE...]`` applies FILE's flags where it stands: one
  flag a line, written as on the command line with ``=`` before a value;
  ``#`` comment lines; nested ``--flagfile`` lines; gflags' program
  sections (a line without a leading ``-`` lists glob patterns, and the
  flags after it apply only to the programs that one of them matches);
* ``--help`` (or ``--helpfull``) and ``--version``, answered by
  :meth:`FlagSet.answer`;
* a list flag (kind ``list``) takes values separated by ``,`` and adds
  those of each repetition (other flags: the last value wins, as in gflags).

Every flag set also has glog's flags (:func:`caffempi.common.add_logging_flags`).

Differences from gflags, each for a reason: bad input is a one-line
CaffeError, which our programs print and exit 1 on (gflags prints
``ERROR: unknown command line flag 'x'`` and exits 1 as well); an unknown
flag or a bad value inside a flagfile is an error too, naming the file and
line (gflags ignores a flagfile's bad lines silently, so a typo there would
go unnoticed); ``--help`` exits 0 (gflags exits 1: asking for help is not a
failure).
"""
import fnmatch
import os
import textwrap
from collections import OrderedDict

from . import __version__
from .common import CaffeError, add_logging_flags

# gflags' names of the flag types, shown by --help (list: ours)
KIND_NAMES = {bool: "bool", int: "int32", float: "double", str: "string", list: "list"}
TRUE_TEXTS = ("1", "t", "true", "y", "yes")
FALSE_TEXTS = ("0", "f", "false", "n", "no")
REQUIRED = object()      # an argument's default when it must be given
HELP_WIDTH = 80


class Flag:
    """``--name``: its default, help line and kind (bool, int, float, str
    or list; the default's type unless given, so a None default needs it)."""

    def __init__(self, name, default, help, kind=None):
        kind = kind or type(default)
        if kind not in KIND_NAMES:
            raise TypeError("flag --%s: kind %r is not bool, int, float, str or list" % (name, kind))
        self.name, self.default, self.help, self.kind = name, default, help, kind

    @property
    def label(self):
        return "--" + self.name

    def convert(self, text):
        """The value of ``text`` (a CaffeError naming the flag when it is not one)."""
        if self.kind is bool:
            low = text.lower()
            if low in TRUE_TEXTS or low in FALSE_TEXTS:
                return low in TRUE_TEXTS
            raise CaffeError("invalid value for %s: '%s' (true or false)" % (self.label, text))
        if self.kind is list:
            return [item for item in text.split(",") if item]
        try:
            return self.kind(text)
        except ValueError:
            raise CaffeError("invalid value for %s: '%s' (%s expected)"
                             % (self.label, text, self.kind.__name__)) from None


class Argument(Flag):
    """A positional argument: its name as the usage line shows it, help,
    kind, default (REQUIRED: it must be given) and whether it takes every
    remaining argument (``repeated``)."""

    def __init__(self, name, help, kind=str, default=REQUIRED, repeated=False):
        super().__init__(name, default, help, kind)
        self.repeated = repeated

    @property
    def label(self):
        return self.name

    @property
    def usage(self):
        text = self.name + ("..." if self.repeated else "")
        return text if self.default is REQUIRED else "[%s]" % text


class Flags:
    """Parsed flag values as attributes (``flags.solver``)."""

    def __init__(self, values):
        self.__dict__.update(values)

    def __repr__(self):
        return "Flags(%r)" % self.__dict__


class FlagSet:
    """One program's command line: ``program`` names it in messages,
    ``description`` is gflags' usage message (the first line of --help),
    ``usage`` the command line's form (default: from the arguments)."""

    def __init__(self, program, description, usage=None):
        self.program, self.description, self._usage = program, description, usage
        self._flags = OrderedDict()
        self.arguments = []
        self.define("help", False, "show help on all flags and exit")
        self.define("helpfull", False, "the same as --help")
        self.define("version", False, "show the version and exit")
        self.define("flagfile", "", "load flags from FILE (several separated by ','): one flag a line, "
                    "'#' comments, nested --flagfile lines")
        add_logging_flags(self.define)
        self._common = set(self._flags)       # listed last by --help

    # ------------------------------------------------------------ declaring
    def define(self, name, default, help, kind=None):
        """Add ``--name`` (kind: bool, int, float, str or list; the
        default's type unless given)."""
        if name in self._flags:
            raise ValueError("%s: flag --%s defined twice" % (self.program, name))
        self._flags[name] = Flag(name, default, help, kind)

    def argument(self, name, help, kind=str, default=REQUIRED, repeated=False):
        """Add the next positional argument (see :class:`Argument`)."""
        self.arguments.append(Argument(name, help, kind, default, repeated))

    def __iter__(self):
        return iter(self._flags)

    def __contains__(self, name):
        return name in self._flags

    # -------------------------------------------------------------- parsing
    def parse(self, argv):
        """(Flags, positional arguments) from an argument list; the
        arguments are converted to their kinds, a missing optional one is
        its default, a repeated one's values end the list.  With --help,
        --helpfull or --version the arguments are not checked (the program
        answers instead of running) and come back as given."""
        values = {name: flag.default for name, flag in self._flags.items()}
        texts = []
        self._apply(list(argv), values, texts, frozenset())
        flags = Flags(values)
        return flags, (texts if _asks_for_answer(flags) else self._arguments(texts))

    def without(self, argv, name):
        """``argv`` less every occurrence of ``--name`` in any form, with its
        value (flagfiles are left as they are)."""
        drop = set()
        for start, end, flag, _ in self._scan(argv):
            if flag is not None and flag.name == name:
                drop.update(range(start, end))
        return [arg for i, arg in enumerate(argv) if i not in drop]

    def _scan(self, argv):
        """(start, end, flag, text) for each item of ``argv``, which spans
        argv[start:end]: a flag and its value's text ("1" or "0" for a bare
        boolean), or a positional argument (flag None) and its text."""
        i = 0
        while i < len(argv):
            arg, start = argv[i], i
            i += 1
            if arg == "--":
                for j in range(i, len(argv)):
                    yield j, j + 1, None, argv[j]
                return
            if not arg.startswith("-") or arg == "-":
                yield start, i, None, arg
                continue
            dashes = "--" if arg.startswith("--") else "-"
            name, eq, value = arg[len(dashes):].partition("=")
            flag = self._flags.get(name)
            if flag is None and name.startswith("no") and name[2:] in self._flags:
                negated = self._flags[name[2:]]
                if negated.kind is not bool:
                    raise CaffeError("%s%s: %s%s is not a boolean flag" % (dashes, name, dashes, negated.name))
                if eq:
                    raise CaffeError("%s%s takes no value" % (dashes, name))
                yield start, i, negated, "0"
                continue
            if flag is None:
                raise CaffeError("unknown flag %s%s (see '%s --help')" % (dashes, name, self.program))
            if not eq:
                if flag.kind is bool:
                    value = "1"
                elif i < len(argv):
                    value = argv[i]
                    i += 1
                else:
                    raise CaffeError("flag %s needs a value" % flag.label)
            yield start, i, flag, value

    def _apply(self, argv, values, texts, open_files):
        """Set ``values`` from ``argv`` in order (a flagfile where it
        stands); positional arguments go to ``texts`` (None: a flagfile's
        line, where they are an error)."""
        for _, _, flag, text in self._scan(argv):
            if flag is None:
                if texts is None:
                    raise CaffeError("'%s' is not a flag" % text)
                texts.append(text)
            elif flag.name == "flagfile":
                for path in text.split(","):
                    if path:
                        self._apply_flagfile(path, values, open_files)
            elif flag.kind is list:
                values[flag.name] = values[flag.name] + flag.convert(text)
            else:
                values[flag.name] = flag.convert(text)

    def _apply_flagfile(self, path, values, open_files):
        real = os.path.realpath(path)
        if real in open_files:
            raise CaffeError("--flagfile=%s includes itself" % path)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise CaffeError("--flagfile=%s: %s" % (path, e.strerror or e)) from None
        relevant, in_section = True, False
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not line.startswith("-"):            # program patterns: a section starts
                if not in_section:
                    in_section, relevant = True, False
                relevant = relevant or any(fnmatch.fnmatch(self.program, p) for p in line.split())
                continue
            in_section = False
            if relevant:
                try:
                    self._apply([line], values, None, open_files | {real})
                except CaffeError as e:
                    raise CaffeError("%s:%d: %s" % (path, number, e)) from None

    def _arguments(self, texts):
        out = []
        for arg in self.arguments:
            if arg.repeated:
                if not texts and arg.default is REQUIRED:
                    raise CaffeError("missing argument %s (usage: %s)" % (arg.name, self.usage_line()))
                out.extend(arg.convert(t) for t in texts)
                texts = []
            elif texts:
                out.append(arg.convert(texts.pop(0)))
            elif arg.default is REQUIRED:
                raise CaffeError("missing argument %s (usage: %s)" % (arg.name, self.usage_line()))
            else:
                out.append(arg.default)
        if texts:
            raise CaffeError("unexpected argument '%s' (usage: %s)" % (texts[0], self.usage_line()))
        return out

    # ----------------------------------------------------------------- help
    def usage_line(self):
        return self._usage or " ".join([self.program, "[FLAGS]"] + [a.usage for a in self.arguments])

    def answer(self, flags):
        """The text that --help/--helpfull or --version asks for (the
        program prints it and exits 0), else None."""
        if not _asks_for_answer(flags):
            return None
        if flags.version and not (flags.help or flags.helpfull):
            return "%s version %s" % (self.program, __version__)
        return self.help_text()

    def help_text(self):
        """gflags' --help: the usage message, then each argument and flag as
        ``-name (help) type: T default: D``."""
        lines = ["%s: %s" % (self.program, self.description), "Usage:", "    " + self.usage_line(), ""]
        if self.arguments:
            lines.append("  Arguments:")
            lines += [_wrap("    %s (%s)" % (a.name, a.help)) for a in self.arguments]
        for title, common in (("Flags:", False), ("Flags of every program (gflags, glog):", True)):
            described = [_describe(f) for name, f in self._flags.items() if (name in self._common) == common]
            lines += ["  " + title] + described if described else []
        return "\n".join(lines)


def _asks_for_answer(flags):
    return flags.help or flags.helpfull or flags.version


def _describe(flag):
    """gflags' line for a flag: ``-name (help) type: T default: D``."""
    if flag.default is None:
        default = ""
    elif flag.kind in (str, list):
        default = ' default: "%s"' % (flag.default if flag.kind is str else ",".join(flag.default))
    else:
        default = " default: %s" % (str(flag.default).lower() if flag.kind is bool else flag.default)
    return _wrap("    -%s (%s) type: %s%s" % (flag.name, flag.help, KIND_NAMES[flag.kind], default))


def _wrap(text):
    return "\n".join(textwrap.wrap(text, HELP_WIDTH, subsequent_indent="      ", break_on_hyphens=False))
