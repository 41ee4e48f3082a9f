package codeinterp_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

// FuzzExecuteBody sends arbitrary bodies to /execute: the server answers
// each with a 4xx or a well-formed stream (every line JSON, the last one an
// end marker) and keeps serving. A body that is valid runs its code, so
// the server interrupts anything past 2 s.
func FuzzExecuteBody(f *testing.F) {
	for _, seed := range []string{
		`{"code": "1 + 1"}`, `{"code": "print('x')", "env_vars": {"A": "b"}}`,
		`{"code": "1", "context_id": "nope"}`, `{"code": "1", "language": "nope"}`,
		`{"code": "1", "language": "python", "context_id": "x"}`, `{"code": null}`,
		`{"code": "1", "env_vars": {"": "x"}}`, `{"code": "1", "env_vars": null}`,
		`null`, `[]`, `"x"`, `{`, `{"code": "\ud800"}`, "\xff\xfe", ``, `{"code": "raise SystemExit"}`,
	} {
		f.Add([]byte(seed))
	}
	s := startServer(f, "--execution-timeout", "2")
	f.Fuzz(func(t *testing.T, body []byte) {
		resp, err := http.Post(s.url+"/execute", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatalf("post %q: %v", body, err)
		}
		defer resp.Body.Close()
		switch resp.StatusCode {
		case 400, 404:
			return
		case 200:
		default:
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("body %q: status %d %s", body, resp.StatusCode, b)
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 64<<20)
		last := ""
		for sc.Scan() {
			var l map[string]any
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				t.Fatalf("body %q: line %q: %v", body, sc.Text(), err)
			}
			last, _ = l["type"].(string)
		}
		if err := sc.Err(); err != nil {
			t.Fatalf("body %q: %v", body, err)
		}
		if last != "end_of_execution" && last != "unexpected_end_of_execution" {
			t.Fatalf("body %q: stream ends with %q", body, last)
		}
	})
}
