package gateway

// Forwarding on a guest connection that has been admitted and dialed:
// shared by sbx-manager (on the socket netgtw hands it) and by the
// in-process Gateway.ServeHTTP.

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/api/spacev1"
)

// GuestRequest is r as the sandbox's server sees it: addressed to
// 127.0.0.1:port, without the capability, with the Host the edge named
// (the client's, or the sandbox's maskRequestHost; without it, the port's
// own address).
func GuestRequest(r *http.Request, port int) *http.Request {
	out := r.Clone(r.Context())
	out.Header.Del(spacev1.HeaderCapability)
	out.URL.Scheme = "http"
	out.URL.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	out.Host = out.URL.Host
	if h := r.Header.Get(spacev1.HeaderRequestHost); h != "" && validHost(h) {
		out.Host = h
	}
	out.Header.Del(spacev1.HeaderRequestHost)
	return out
}

// CheckTCPUpgrade refuses an "Upgrade: tcp" request without
// "Connection: Upgrade".
func CheckTCPUpgrade(r *http.Request) error {
	if !headerHasToken(r.Header, "Connection", "upgrade") {
		return errors.New("an \"Upgrade: tcp\" request needs \"Connection: Upgrade\"")
	}
	return nil
}

// ServeTCP answers an admitted "Upgrade: tcp" request on the guest
// connection gc: it switches protocols and carries raw bytes until either
// side closes or ctx ends. The caller closes gc.
func ServeTCP(ctx context.Context, w http.ResponseWriter, r *http.Request, gc net.Conn) {
	cc, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, "", "cannot take over the connection")
		return
	}
	defer cc.Close()
	_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
	if err := brw.Flush(); err != nil {
		return
	}
	splice(ctx, cc, brw.Reader, gc)
}

// ProxyOn forwards the guest request out (see GuestRequest) on the one
// guest connection gc and writes the answer to w; an upgrade (WebSocket)
// is passed through and spliced after its 101. gc serves this request
// only: it is never pooled, so every guest connection was admitted for
// the request it carries. The caller closes gc.
func ProxyOn(w http.ResponseWriter, out *http.Request, gc net.Conn, bufs *BufferPool, errorLog *slog.Logger) {
	var used atomic.Bool
	tr := &http.Transport{
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			if used.Swap(true) {
				return nil, errors.New("guest connection already used")
			}
			return gc, nil
		},
		DisableKeepAlives:  true,
		DisableCompression: true,
		MaxConnsPerHost:    1,
	}
	defer tr.CloseIdleConnections()
	p := &httputil.ReverseProxy{
		Rewrite:       func(*httputil.ProxyRequest) {},
		Transport:     tr,
		FlushInterval: -1,
		BufferPool:    bufs,
		ErrorLog:      slog.NewLogLogger(errorLog.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return
			}
			writeJSON(w, http.StatusBadGateway, "", "sandbox port unreachable: "+err.Error())
		},
	}
	p.ServeHTTP(w, out)
}

// splice copies client->guest (after draining what the client's reader
// already buffered) and guest->client until one direction ends or ctx is
// done; then both connections are closed by the caller.
func splice(ctx context.Context, client net.Conn, buffered *bufio.Reader, guest net.Conn) {
	done := make(chan struct{}, 2)
	go func() {
		var src io.Reader = client
		if buffered != nil && buffered.Buffered() > 0 {
			src = io.MultiReader(io.LimitReader(buffered, int64(buffered.Buffered())), client)
		}
		_, _ = io.Copy(guest, src)
		if cw, ok := guest.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(client, guest)
		if cw, ok := client.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		done <- struct{}{}
	}()
	got := 0
	select {
	case <-ctx.Done():
	case <-done:
		got++
		// One direction ended: give the other a moment to drain.
		select {
		case <-done:
			got++
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
		}
	}
	client.Close()
	guest.Close()
	for ; got < 2; got++ {
		<-done
	}
}
