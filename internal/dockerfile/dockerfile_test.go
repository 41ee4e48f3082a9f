package dockerfile

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
)

func TestParse(t *testing.T) {
	const df = `# syntax=docker/dockerfile:1
ARG BASE=base
FROM ${BASE}
ARG VERSION=1.2
ARG EMPTY
LABEL maintainer=x
ENV APP_HOME=/opt/app GREETING="hello world"
ENV LEGACY value with spaces
WORKDIR $APP_HOME
RUN apt-get update && \
    # a comment inside
    apt-get install -y curl
RUN ["echo", "it's", "$VERSION"]
COPY --chown=user:user --chmod=755 app.py conf/ ./
ADD data.tar.gz /data/
COPY a b
USER user
WORKDIR sub
EXPOSE 8000
ENTRYPOINT ["python3", "-m"]
CMD ["http.server", "8000"]
`
	b, err := Parse(strings.NewReader(df), map[string]string{"VERSION": "2.0"})
	if err != nil {
		t.Fatal(err)
	}
	if b.From != "base" {
		t.Errorf("From %q", b.From)
	}
	want := []e2bapi.TemplateStep{
		{Type: "ENV", Args: []string{"APP_HOME", "/opt/app", "GREETING", "hello world"}},
		{Type: "ENV", Args: []string{"LEGACY", "value with spaces"}},
		{Type: "WORKDIR", Args: []string{"/opt/app"}},
		{Type: "RUN", Args: []string{"export VERSION=2.0 EMPTY=''; apt-get update &&  apt-get install -y curl"}},
		{Type: "RUN", Args: []string{`export VERSION=2.0 EMPTY=''; echo 'it'\''s' '$VERSION'`}},
		{Type: "COPY", Args: []string{"app.py", "/opt/app/", "user", "755"}},
		{Type: "COPY", Args: []string{"conf", "/opt/app/", "user", "755"}},
		{Type: "COPY", Args: []string{"data.tar.gz", "/data/", "root", ""}},
		{Type: "COPY", Args: []string{"a", "/opt/app/b", "root", ""}},
		{Type: "USER", Args: []string{"user"}},
		{Type: "WORKDIR", Args: []string{"/opt/app/sub"}},
	}
	if !reflect.DeepEqual(b.Steps, want) {
		for i := range max(len(b.Steps), len(want)) {
			var g, w e2bapi.TemplateStep
			if i < len(b.Steps) {
				g = b.Steps[i]
			}
			if i < len(want) {
				w = want[i]
			}
			if !reflect.DeepEqual(g, w) {
				t.Errorf("step %d:\n got  %q %q\n want %q %q", i, g.Type, g.Args, w.Type, w.Args)
			}
		}
	}
	if b.StartCmd != "python3 -m http.server 8000" {
		t.Errorf("StartCmd %q", b.StartCmd)
	}
	if len(b.Warnings) != 3 { // LABEL, ADD archive, EXPOSE
		t.Errorf("warnings %q", b.Warnings)
	}
}

func TestParseRejects(t *testing.T) {
	for name, df := range map[string]string{
		"no FROM":         "RUN true\n",
		"empty":           "# nothing\n",
		"multi-stage":     "FROM base\nFROM other\n",
		"COPY --from":     "FROM base\nCOPY --from=build /a /b\n",
		"ADD URL":         "FROM base\nADD https://example.com/x /x\n",
		"escape context":  "FROM base\nCOPY ../secret /x\n",
		"absolute source": "FROM base\nCOPY /etc/shadow /x\n",
		"inner escape":    "FROM base\nCOPY a/../../b /x\n",
		"wildcard":        "FROM base\nCOPY *.py /x/\n",
		"scratch":         "FROM scratch\n",
		"unknown":         "FROM base\nFROBNICATE x\n",
		"bad ENV":         "FROM base\nENV 1A=b\n",
		"open quote":      "FROM base\nENV A=\"b\n",
		"bad chmod":       "FROM base\nCOPY --chmod=999 a /b\n",
		"COPY one arg":    "FROM base\nCOPY a\n",
		"RUN flags":       "FROM base\nRUN --mount=type=cache,target=/x true\n",
		"USER blank":      "FROM base\nUSER \n",
		"too big":         "FROM base\n" + strings.Repeat("RUN true\n", MaxInstructions+1),
	} {
		_, err := Parse(strings.NewReader(df), nil)
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want an invalid error", name, err)
		}
	}
	var de *Error
	_, err := Parse(strings.NewReader("FROM base\n\nRUN true\nBOGUS\n"), nil)
	if !errors.As(err, &de) || de.Line != 4 {
		t.Errorf("line of the error: %v", err)
	}
}

func FuzzParse(f *testing.F) {
	f.Add("FROM base\nRUN echo ${A:-x} $B \\\n && true\nCOPY a b/\nENV A=\"1 2\" B='3'\n")
	f.Add("ARG X=1\nFROM $X\nCMD [\"a\", \"b\"]\n")
	f.Fuzz(func(t *testing.T, s string) {
		b, err := Parse(strings.NewReader(s), nil)
		if err != nil {
			return
		}
		for _, st := range b.Steps {
			if st.Type == "COPY" && (strings.HasPrefix(st.Args[0], "/") || st.Args[0] == ".." || strings.HasPrefix(st.Args[0], "../")) {
				t.Fatalf("a COPY source outside the context: %q", st.Args[0])
			}
		}
	})
}

func TestStages(t *testing.T) {
	const df = `ARG GO=1.26
FROM golang:${GO}-bookworm AS Build
WORKDIR /src
COPY go.mod go.sum ./
RUN go build \
    -o /out/ ./cmd/x
FROM debian:bookworm-slim AS runtime
COPY --from=build /out/x /usr/local/bin/x
ENTRYPOINT ["/usr/local/bin/x", "-v"]
FROM runtime
CMD echo hi
`
	st, err := Stages(strings.NewReader(df))
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 3 || st[0].Name != "build" || st[0].From != "golang:1.26-bookworm" || st[1].Name != "runtime" || st[2].Name != "" || st[2].From != "runtime" {
		t.Fatalf("stages %+v", st)
	}
	if in := st[0].Instructions[2]; in.Keyword != "RUN" || in.Line != 5 || in.Args != "go build  -o /out/ ./cmd/x" {
		t.Errorf("RUN %+v", in)
	}
	from, srcs, dest, err := st[1].Instructions[0].Copy()
	if err != nil || from != "build" || !reflect.DeepEqual(srcs, []string{"/out/x"}) || dest != "/usr/local/bin/x" {
		t.Errorf("COPY %q %q %q %v", from, srcs, dest, err)
	}
	if argv, ok := st[1].Instructions[1].Exec(); !ok || !reflect.DeepEqual(argv, []string{"/usr/local/bin/x", "-v"}) {
		t.Errorf("ENTRYPOINT %q %v", argv, ok)
	}
	if _, ok := st[2].Instructions[0].Exec(); ok {
		t.Error("shell form read as exec form")
	}
	for _, bad := range []string{"", "RUN x\nFROM a", "FROM a b", "FROM a\nCOPY x"} {
		_, err := Stages(strings.NewReader(bad))
		if err == nil {
			if bad == "FROM a\nCOPY x" {
				continue // Stages reads; COPY's form is checked by Copy
			}
			t.Errorf("%q: accepted", bad)
		}
	}
	st, _ = Stages(strings.NewReader("FROM a\nCOPY x"))
	if _, _, _, err := st[0].Instructions[0].Copy(); err == nil {
		t.Error("COPY with one word accepted")
	}
}
