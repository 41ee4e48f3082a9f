package gateway

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
)

// TestAnswerBeforeTheWholeBody: a sandbox server that answers while the
// request body is still arriving gets the rest of the body and its answer
// streams back at once. Without full duplex the gateway's server held the
// answer until it had discarded the body (and then closed it under the
// transport, which cut the guest connection: the code interpreter lost
// about 1 in 100 runCode answers that way).
func TestAnswerBeforeTheWholeBody(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).EnableFullDuplex()
		first := make([]byte, 5)
		if _, err := io.ReadFull(r.Body, first); err != nil {
			t.Errorf("guest: first half: %v", err)
			return
		}
		fmt.Fprintf(w, "got %s;", first)
		w.(http.Flusher).Flush()
		rest, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("guest: second half: %v", err)
			return
		}
		fmt.Fprintf(w, "got %s", rest)
	}))
	srv := httptest.NewServer(f.gw)
	t.Cleanup(srv.Close)
	tok := f.token(t, testRoute(), f.port, ProtocolHTTP)

	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /run HTTP/1.1\r\nHost: x\r\n%s: %d\r\n%s: %s\r\nContent-Length: 10\r\n\r\nhello", HeaderSandboxPort, f.port, spacev1.HeaderCapability, tok)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer while the body was still arriving: %v", err)
	}
	if res.StatusCode != http.StatusOK {
		t.Fatalf("status %d", res.StatusCode)
	}
	buf := make([]byte, len("got hello;"))
	if _, err := io.ReadFull(res.Body, buf); err != nil || string(buf) != "got hello;" {
		t.Fatalf("first part %q, %v", buf, err)
	}
	io.WriteString(c, "world")
	rest, err := io.ReadAll(res.Body)
	if err != nil || string(rest) != "got world" {
		t.Fatalf("second part %q, %v", rest, err)
	}
}

// TestManyAnswersAsSoonAsTheBodyIsRead: a server that answers the moment
// it has read the body, over one kept-alive guest connection, loses no
// answer (the transport's last read of the body, the one that sees EOF,
// races the answer).
func TestManyAnswersAsSoonAsTheBodyIsRead(t *testing.T) {
	f := newFixture(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b := make([]byte, r.ContentLength)
		if _, err := io.ReadFull(r.Body, b); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.(http.Flusher).Flush()
		for i := range 3 {
			fmt.Fprintf(w, "%s %d\n", b, i)
			w.(http.Flusher).Flush()
		}
	}))
	srv := httptest.NewServer(f.gw)
	t.Cleanup(srv.Close)
	tok := f.token(t, testRoute(), f.port, ProtocolHTTP)
	cl := &http.Client{Timeout: 10 * time.Second}
	const n = 500
	failed := 0
	for i := range n {
		body := fmt.Sprintf(`{"code":"%d"}`, i)
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/execute", strings.NewReader(body))
		req.Header.Set(HeaderSandboxPort, fmt.Sprint(f.port))
		req.Header.Set(spacev1.HeaderCapability, tok)
		res, err := cl.Do(req)
		if err != nil {
			failed++
			continue
		}
		got, err := io.ReadAll(res.Body)
		res.Body.Close()
		if err != nil || strings.Count(string(got), body) != 3 {
			failed++
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d answers lost or cut", failed, n)
	}
}
