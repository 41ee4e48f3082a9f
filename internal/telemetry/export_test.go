package telemetry

import (
	"context"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// currentFlush flushes the installed SDK provider (tests).
func currentFlush() error {
	if tp, ok := otel.GetTracerProvider().(*sdktrace.TracerProvider); ok {
		return tp.ForceFlush(context.Background())
	}
	return nil
}
